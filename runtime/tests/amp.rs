//! Autocast dtypes and the dynamic grad scaler (CPU, real libtorch).

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[test]
fn autocast_runs_matmuls_in_the_chosen_dtype_and_restores_the_state() {
    let a = Tensor::randn([4, 4], (Kind::Float, Device::Cpu));
    let y = tchmem::amp::autocast_on(Device::Cpu, Kind::BFloat16, || a.matmul(&a));
    assert_eq!(y.kind(), Kind::BFloat16);
    let nested = tchmem::amp::autocast_on(Device::Cpu, Kind::BFloat16, || {
        tchmem::amp::autocast_on(Device::Cpu, Kind::Half, || a.matmul(&a))
    });
    assert_eq!(nested.kind(), Kind::Half);
    assert_eq!(
        a.matmul(&a).kind(),
        Kind::Float,
        "autocast stays off outside"
    );
    let after_panic = std::panic::catch_unwind(|| {
        tchmem::amp::autocast_on(Device::Cpu, Kind::BFloat16, || panic!("inside"))
    });
    assert!(after_panic.is_err());
    assert_eq!(a.matmul(&a).kind(), Kind::Float, "restored after a panic");
}

/// CPU autocast hands an LSTM's oneDNN kernel its dtype even where oneDNN cannot run it (bf16
/// without AVX-512 BF16; f16 even with AVX-512 FP16, as on a 2026-12-04 CI machine); the LSTM
/// must still train, in reduced precision (its result differs from f32's, slightly), and f32
/// afterwards must be as before.
#[test]
fn an_lstm_trains_under_cpu_autocast_on_any_cpu() {
    use tch::nn::RNN;
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let lstm = nn::lstm(vs.root(), 8, 16, Default::default());
    let x = Tensor::randn([4, 5, 8], (Kind::Float, Device::Cpu));
    let (full, _) = lstm.seq(&x);
    for dtype in [Kind::BFloat16, Kind::Half] {
        let (y, _) = tchmem::amp::autocast_on(Device::Cpu, dtype, || lstm.seq(&x));
        y.to_kind(Kind::Float).sum(Kind::Float).backward();
        for (name, v) in vs.variables() {
            let g = v.grad();
            assert!(g.defined(), "{dtype:?}: no gradient for {name}");
            assert!(
                g.isfinite().all().int64_value(&[]) == 1,
                "{dtype:?}: {name}"
            );
        }
        let gap = (y.to_kind(Kind::Float) - &full)
            .abs()
            .max()
            .double_value(&[]);
        assert!(gap > 0.0 && gap < 0.1, "{dtype:?}: off f32 by {gap}");
        for mut g in vs.trainable_variables().iter().map(Tensor::grad) {
            let _ = g.zero_();
        }
    }
    let (again, _) = lstm.seq(&x);
    // oneDNN's switch is process-wide and the other tests here run autocast on other threads
    // meanwhile, so this LSTM may take either kernel: the same f32 result up to rounding.
    assert!(
        again.allclose(&full, 1e-5, 1e-6, false),
        "f32 after autocast as before it"
    );
}

fn setup() -> (nn::VarStore, impl Module, Tensor) {
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = nn::linear(vs.root(), 8, 1, Default::default());
    let x = Tensor::randn([16, 8], (Kind::Float, Device::Cpu));
    (vs, model, x)
}

#[test]
fn the_scaler_unscales_gradients_before_the_step() {
    let (vs, model, x) = setup();
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let mut scaler = tchmem::amp::GradScaler::with_scale(&vs, 1024.0);
    let loss = model.forward(&x).square().mean(Kind::Float);
    opt.zero_grad();
    scaler.scale(&loss).backward();
    scaler.unscale();
    let scaled_then_unscaled: Vec<Tensor> = vs
        .trainable_variables()
        .iter()
        .map(|v| v.grad().copy())
        .collect();
    opt.zero_grad();
    model.forward(&x).square().mean(Kind::Float).backward();
    for (got, plain) in scaled_then_unscaled.iter().zip(vs.trainable_variables()) {
        let diff = (got - plain.grad()).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "unscaled gradients differ by {diff}");
    }
}

#[test]
fn a_step_with_an_inf_gradient_is_skipped_and_the_scale_backs_off() {
    let (vs, model, x) = setup();
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let mut scaler = tchmem::amp::GradScaler::new(&vs);
    let before: Vec<Tensor> = vs.trainable_variables().iter().map(|v| v.copy()).collect();

    // An injected inf in the loss makes every gradient non-finite.
    let loss = model.forward(&x).square().mean(Kind::Float) * f64::INFINITY;
    assert!(
        !scaler.backward_step(&mut opt, &loss),
        "the step must be skipped"
    );
    assert_eq!(scaler.skipped_steps(), 1);
    assert_eq!(scaler.scale_value(), 32768.0);
    for (v, old) in vs.trainable_variables().iter().zip(&before) {
        assert_eq!(
            (v - old).abs().max().double_value(&[]),
            0.0,
            "parameters moved"
        );
    }

    let loss = model.forward(&x).square().mean(Kind::Float);
    assert!(scaler.backward_step(&mut opt, &loss));
    let moved = vs
        .trainable_variables()
        .iter()
        .zip(&before)
        .any(|(v, old)| (v - old).abs().max().double_value(&[]) > 0.0);
    assert!(moved, "a finite step updates the parameters");
}

#[test]
fn the_scale_grows_after_the_growth_interval() {
    let (vs, model, x) = setup();
    let mut opt = nn::Sgd::default().build(&vs, 0.01).unwrap();
    let mut scaler = tchmem::amp::GradScaler::with_scale(&vs, 8.0);
    scaler.growth_interval = 3;
    for _ in 0..3 {
        let loss = model.forward(&x).square().mean(Kind::Float);
        assert!(scaler.backward_step(&mut opt, &loss));
    }
    assert_eq!(scaler.scale_value(), 16.0);
}

#[test]
fn the_scaler_unscales_variables_added_after_it_was_made() {
    let (vs, model, x) = setup();
    let mut scaler = tchmem::amp::GradScaler::with_scale(&vs, 1024.0);
    // A layer created after the scaler.
    let head = nn::linear(vs.root() / "late", 1, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let loss = head.forward(&model.forward(&x)).square().mean(Kind::Float);
    opt.zero_grad();
    scaler.scale(&loss).backward();
    scaler.unscale();
    let scaled: Vec<Tensor> = vs
        .trainable_variables()
        .iter()
        .map(|v| v.grad().copy())
        .collect();
    opt.zero_grad();
    head.forward(&model.forward(&x))
        .square()
        .mean(Kind::Float)
        .backward();
    for (got, v) in scaled.iter().zip(vs.trainable_variables()) {
        let diff = (got - v.grad()).abs().max().double_value(&[]);
        assert!(diff < 1e-5, "a gradient stayed scaled (off by {diff})");
    }
}
