//! A measured run stops after its steps and keeps each step's loss and time (CPU).

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[test]
fn a_run_stops_after_its_steps_with_losses_and_times() {
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
