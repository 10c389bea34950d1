//! The allocator's knobs and what a measured run and the OOM observer read from it on CUDA
//! (each CUDA test does nothing without a CUDA device; they share the device, so they take
//! turns).

use std::sync::Mutex;

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use tchmem::cuda_stats;
use tchmem::estimate::shapes;

/// The allocator's counters are process-wide: one test at a time.
static DEVICE: Mutex<()> = Mutex::new(());

fn cuda() -> Option<std::sync::MutexGuard<'static, ()>> {
    tch::Cuda::is_available().then(|| DEVICE.lock().unwrap_or_else(|e| e.into_inner()))
}

#[test]
fn a_memory_fraction_outside_zero_to_one_is_refused_with_the_range() {
    for fraction in [0.0, -0.5, 1.5, f64::NAN] {
        let why = cuda_stats::set_memory_fraction(fraction).unwrap_err();
        assert!(why.to_string().contains("(0, 1]"), "{why}");
    }
    if !tch::Cuda::is_available() {
        assert!(cuda_stats::memory_fraction().is_err());
        assert!(cuda_stats::free_cache().is_err());
    }
}

#[test]
fn a_run_on_cuda_splits_its_peak_by_phase_and_keeps_the_overall_peak() {
    let Some(_turn) = cuda() else { return };
    let device = Device::Cuda(0);
    let vs = nn::VarStore::new(device);
    let model = nn::seq()
        .add(nn::linear(vs.root() / "a", 1024, 4096, Default::default()))
        .add_fn(|x| x.gelu("none"))
        .add(nn::linear(vs.root() / "b", 4096, 1024, Default::default()));
    tchmem::watch(&vs);
    let mut opt = tchmem::optim::AdamW::default().build(&vs, 1e-3).unwrap();
    let x = Tensor::randn([8192, 1024], (Kind::Float, device));

    tchmem::compare::begin(3);
    for _ in 0..100 {
        tchmem::phase::forward();
        let loss = model.forward(&x).square().mean(Kind::Float);
        tchmem::phase::backward();
        opt.zero_grad();
        loss.backward();
        tchmem::phase::step();
        opt.step();
        tchmem::phase::end();
        if tchmem::compare::record_step(&loss) {
            break;
        }
    }
    let run = tchmem::compare::finish().0;
    assert_eq!(run.parameters, shapes(&vs));
    let phases = run.phase_peaks.expect("phase peaks on CUDA");
    let peak = run.peak_allocated.unwrap();
    // 8192 × 4096 f32 activations (128 MiB, several of them) against 2 × 32 MiB of moments.
    assert!(
        phases.forward_backward > phases.step && phases.step > 0,
        "{phases:?}"
    );
    // The markers restart the allocator's peaks, the run's peak is still the highest of all.
    assert_eq!(peak, phases.forward_backward.max(phases.step), "{run:?}");
    assert!(run.peak_reserved.unwrap() >= peak);
}

#[test]
fn a_capped_allocator_fails_above_its_fraction_and_the_observer_notes_the_counters() {
    let Some(_turn) = cuda() else { return };
    tchmem::oom::attach_observer().unwrap();
    let vs = nn::VarStore::new(Device::Cuda(0));
    let _weights = vs.root().zeros("w", &[1 << 20]);
    tchmem::watch(&vs);
    let (_, total) = cuda_stats::memory_info(0).unwrap();
    assert_eq!(cuda_stats::memory_fraction().unwrap(), 1.0);

    cuda_stats::set_memory_fraction(0.5).unwrap();
    assert!((cuda_stats::memory_fraction().unwrap() - 0.5).abs() < 1e-9);
    tchmem::oom::take_events();
    let too_much = Tensor::f_empty([(total * 3 / 4) as i64], (Kind::Uint8, Device::Cuda(0)));
    cuda_stats::set_memory_fraction(1.0).unwrap();
    assert!(
        too_much.is_err(),
        "three quarters of the device under a cap of half"
    );

    let events = tchmem::oom::take_events();
    let event = events.last().expect("the observer saw the failure");
    // Rounded up to the allocator's 2 MiB granularity.
    assert!(event.requested >= total * 3 / 4, "{event:?}");
    assert!(event.allocated.unwrap() >= 4 << 20, "{event:?}");
    assert!(event.reserved.unwrap() >= event.allocated.unwrap());
    assert_eq!(event.parameters, Some(4 << 20));
    assert_eq!(event.gradients, Some(0));
    // The cap is lifted again.
    let fits = Tensor::f_empty([(total * 3 / 5) as i64], (Kind::Uint8, Device::Cuda(0)));
    assert!(fits.is_ok());
}

#[test]
fn freeing_the_cache_returns_what_dropped_tensors_left_reserved() {
    let Some(_turn) = cuda() else { return };
    let kept = Tensor::ones([1 << 20], (Kind::Float, Device::Cuda(0)));
    drop(Tensor::ones([256 << 20], (Kind::Float, Device::Cuda(0))));
    let freed = cuda_stats::free_cache().unwrap();
    assert!(freed.released() >= 1 << 30, "{freed:?}");
    assert!(freed.allocated >= 4 << 20);
    assert!(freed.reserved_after >= freed.allocated);
    drop(kept);
}
