//! A measured run stops after its steps and keeps each step's loss and time (CPU).

use std::sync::{Mutex, MutexGuard};

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

/// A run is process-wide (between `begin` and `finish`): one test's run at a time.
fn one_run_at_a_time() -> MutexGuard<'static, ()> {
    static RUN: Mutex<()> = Mutex::new(());
    RUN.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn a_run_stops_after_its_steps_with_losses_and_times() {
    let _run = one_run_at_a_time();
    let vs = nn::VarStore::new(Device::Cpu);
    let model = nn::linear(vs.root(), 4, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let x = Tensor::randn([32, 4], (Kind::Float, Device::Cpu));
    let y = x.sum_dim_intlist([1i64].as_slice(), true, Kind::Float);

    // Outside a run nothing is recorded.
    assert!(!tchmem::compare::record_step(&Tensor::from(1.0)));

    tchmem::compare::begin(3);
    let mut steps = 0;
    for _ in 0..100 {
        let loss = model.forward(&x).mse_loss(&y, tch::Reduction::Mean);
        opt.backward_step(&loss);
        steps += 1;
        if tchmem::compare::record_step(&loss) {
            break;
        }
    }
    let run = tchmem::compare::finish().0;
    assert_eq!(steps, 3);
    assert_eq!(run.steps_wanted, 3);
    assert_eq!(run.losses.len(), 3);
    assert!(run.losses[2] < run.losses[0], "{:?}", run.losses);
    assert_eq!(run.step_seconds.len(), 3);
    assert!(run.typical_step_seconds().unwrap() > 0.0);
    assert!(
        run.peak_allocated.is_none(),
        "allocator peaks are CUDA-only"
    );
    assert_eq!(run.at_last_step.unwrap().device, "cpu");
    // The run is over.
    assert_eq!(tchmem::compare::finish().0.losses.len(), 0);
}

#[test]
fn a_run_keeps_the_shapes_of_the_watched_parameters_after_they_are_dropped() {
    let _run = one_run_at_a_time();
    // A model the notebook held before the run: not the loop's.
    let earlier = nn::VarStore::new(Device::Cpu);
    let _earlier_layer = nn::linear(earlier.root(), 16, 16, Default::default());
    tchmem::watch(&earlier);

    tchmem::compare::begin(2);
    // The loop's model, made in the run as the kernel's cells make it.
    let vs = nn::VarStore::new(Device::Cpu);
    let model = nn::linear(vs.root(), 4, 2, Default::default());
    let _frozen = vs.root().zeros_no_train("frozen", &[3]);
    tchmem::watch(&vs);
    let mut opt = nn::Adam::default().build(&vs, 0.1).unwrap();
    let x = Tensor::randn([8, 4], (Kind::Float, Device::Cpu));
    for _ in 0..100 {
        let loss = tchmem::phase::train_step(&mut opt, || model.forward(&x).mean(Kind::Float));
        if tchmem::compare::record_step(&loss) {
            break;
        }
    }
    // As in the kernel's cell, the loop's block drops the model before the run finishes.
    drop((model, opt, vs));
    let run = tchmem::compare::finish().0;
    let mut dims: Vec<Vec<i64>> = run.parameters.iter().map(|p| p.dims.clone()).collect();
    dims.sort();
    assert_eq!(
        dims,
        [vec![2], vec![2, 4]],
        "the run's trainable variables only"
    );
    if !tch::Cuda::is_available() {
        assert_eq!(run.phase_peaks, None, "phase peaks are CUDA-only");
    }
}
