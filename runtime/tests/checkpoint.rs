//! Checkpointed models give the same gradients as plain ones (CPU, real libtorch).

use tch::nn::{self, Module, ModuleT, OptimizerConfig};
use tch::{Device, Kind, Tensor};

mod common;
use common::rng_turn;

fn mlp_t(root: nn::Path, checkpointed: bool, segments: Option<usize>) -> Box<dyn ModuleT> {
    let dims = [16, 64, 64, 64, 64, 8];
    macro_rules! build {
        ($seq:expr) => {{
            let mut model = $seq;
            for (i, pair) in dims.windows(2).enumerate() {
                model = model
                    .add(nn::linear(&root / i, pair[0], pair[1], Default::default()))
                    .add_fn(|x| x.gelu("none"))
                    .add_fn_t(|x, train| x.dropout(0.3, train));
            }
            model
        }};
    }
    if checkpointed {
        let mut model = build!(tchmem::checkpoint::seq_t());
        if let Some(n) = segments {
            model = model.segments(n);
        }
        Box::new(model)
    } else {
        Box::new(build!(nn::seq_t()))
    }
}

/// Gradients of every variable after one backward pass, by name.
fn gradients(
    vs: &nn::VarStore,
    model: &dyn ModuleT,
    x: &Tensor,
    seed: i64,
) -> Vec<(String, Tensor)> {
    tch::manual_seed(seed);
    let loss = model.forward_t(x, true).square().mean(Kind::Float);
    loss.backward();
    let mut grads: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .map(|(name, v)| (name, v.grad().copy()))
        .collect();
    grads.sort_by(|a, b| a.0.cmp(&b.0));
    grads
}

fn max_abs_diff(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|((na, ta), (nb, tb))| {
            assert_eq!(na, nb);
            assert!(ta.defined() && tb.defined(), "{na} has no gradient");
            (ta - tb).abs().max().double_value(&[])
        })
        .fold(0.0, f64::max)
}

#[test]
fn checkpointed_gradients_equal_plain_ones_with_dropout() {
    let _turn = rng_turn();
    let plain_vs = nn::VarStore::new(Device::Cpu);
    let plain = mlp_t(plain_vs.root(), false, None);
    let x = Tensor::randn([32, 16], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let expected = gradients(&plain_vs, plain.as_ref(), &x, 7);
    let input_grad = x.grad().copy();

    for segments in [None, Some(1), Some(2), Some(18)] {
        let mut vs = nn::VarStore::new(Device::Cpu);
        let model = mlp_t(vs.root(), true, segments);
        vs.copy(&plain_vs).unwrap();
        let x2 = x.detach().set_requires_grad(true);
        let got = gradients(&vs, model.as_ref(), &x2, 7);
        let diff = max_abs_diff(&expected, &got);
        println!("segments {segments:?}: max |grad diff| = {diff:e}");
        assert!(
            diff <= 1e-6,
            "segments {segments:?}: gradients differ by {diff}"
        );
        let input_diff = (&input_grad - x2.grad()).abs().max().double_value(&[]);
        assert!(input_diff <= 1e-6, "input gradient differs by {input_diff}");
    }
}

#[test]
fn a_different_seed_gives_different_dropout_so_the_check_is_not_vacuous() {
    let _turn = rng_turn();
    let vs = nn::VarStore::new(Device::Cpu);
    let model = mlp_t(vs.root(), true, None);
    let x = Tensor::randn([32, 16], (Kind::Float, Device::Cpu));
    let a = gradients(&vs, model.as_ref(), &x, 1);
    for (_, v) in vs.variables() {
        let _ = v.grad().zero_();
    }
    let b = gradients(&vs, model.as_ref(), &x, 2);
    assert!(max_abs_diff(&a, &b) > 1e-4);
}

#[test]
fn seq_matches_nn_seq_and_runs_plainly_without_grad() {
    let _turn = rng_turn();
    let vs = nn::VarStore::new(Device::Cpu);
    let plain = nn::seq()
        .add(nn::linear(vs.root() / "a", 8, 8, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(vs.root() / "b", 8, 8, Default::default()))
        .add_fn(|x| x.tanh());
    let mut vs2 = nn::VarStore::new(Device::Cpu);
    let model = tchmem::checkpoint::seq()
        .add(nn::linear(vs2.root() / "a", 8, 8, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(vs2.root() / "b", 8, 8, Default::default()))
        .add_fn(|x| x.tanh())
        .segments(2);
    vs2.copy(&vs).unwrap();
    assert_eq!(model.len(), 4);
    let x = Tensor::randn([4, 8], (Kind::Float, Device::Cpu));
    let y = model.forward(&x);
    assert!(
        y.requires_grad(),
        "the checkpointed output must be part of the graph"
    );
    assert_eq!((plain.forward(&x) - &y).abs().max().double_value(&[]), 0.0);
    let eval = tch::no_grad(|| model.forward(&x));
    assert!(!eval.requires_grad());
}

/// The message of a caught panic (checkpoint() panics with a String).
fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .unwrap_or_default()
}

#[test]
fn a_panicking_segment_is_reported_not_aborted() {
    let _turn = rng_turn();
    let x = Tensor::ones([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let result = std::panic::catch_unwind(|| {
        tchmem::checkpoint::checkpoint(|_| panic!("segment broke"), &x)
    });
    let text = panic_text(result.expect_err("the segment panicked"));
    assert!(text.contains("segment broke"), "{text}");
}

#[test]
fn a_segment_failing_in_backward_surfaces_as_an_error() {
    let _turn = rng_turn();
    let x = Tensor::ones([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = calls.clone();
    let y = tchmem::checkpoint::checkpoint(
        move |x| {
            if counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 1 {
                panic!("recompute broke");
            }
            // Saves x for backward, so backward reruns the segment.
            x * x
        },
        &x,
    );
    let err = y.sum(Kind::Float).f_backward();
    let message = format!("{:?}", err);
    assert!(message.contains("recompute broke"), "{message}");
}

#[test]
fn checkpointing_under_autocast_trains_like_the_plain_model_over_several_steps() {
    use tch::nn::OptimizerConfig;
    let _turn = rng_turn();
    let build = |vs: &nn::VarStore, checkpointed: bool| -> Box<dyn Module> {
        let dims = [16i64, 32, 32, 32, 8];
        macro_rules! layers {
            ($seq:expr) => {{
                let mut model = $seq;
                for (i, pair) in dims.windows(2).enumerate() {
                    model = model
                        .add(nn::linear(
                            vs.root() / i,
                            pair[0],
                            pair[1],
                            Default::default(),
                        ))
                        .add_fn(|x| x.tanh());
                }
                model
            }};
        }
        if checkpointed {
            Box::new(layers!(tchmem::checkpoint::seq()).segments(4))
        } else {
            Box::new(layers!(nn::seq()))
        }
    };
    let plain_vs = nn::VarStore::new(Device::Cpu);
    let plain = build(&plain_vs, false);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let checkpointed = build(&vs, true);
    vs.copy(&plain_vs).unwrap();
    let x = Tensor::randn([8, 16], (Kind::Float, Device::Cpu));
    let mut plain_opt = nn::Sgd::default().build(&plain_vs, 0.5).unwrap();
    let mut opt = nn::Sgd::default().build(&vs, 0.5).unwrap();
    let step = |model: &dyn Module, opt: &mut nn::Optimizer| {
        let loss = tchmem::amp::autocast_on(Device::Cpu, Kind::BFloat16, || {
            model
                .forward(&x)
                .to_kind(Kind::Float)
                .square()
                .mean(Kind::Float)
        });
        opt.backward_step(&loss);
        loss.double_value(&[])
    };
    for i in 0..4 {
        let a = step(plain.as_ref(), &mut plain_opt);
        let b = step(checkpointed.as_ref(), &mut opt);
        // Stale autocast copies of the weights would make step 2 onwards differ.
        assert!(
            (a - b).abs() <= 1e-6,
            "step {i}: loss {a} plain vs {b} checkpointed"
        );
    }
    let variables = vs.variables();
    for (name, p) in plain_vs.variables() {
        let diff = (&p - &variables[&name]).abs().max().double_value(&[]);
        assert!(diff <= 1e-6, "{name} differs by {diff}");
    }
}

#[test]
fn the_rerun_stops_after_the_last_tensor_backward_needs() {
    let _turn = rng_turn();
    let x = Tensor::randn([4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let after_last_save = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = after_last_save.clone();
    let y = tchmem::checkpoint::checkpoint(
        move |x| {
            // `sin` saves x; nothing after it saves anything, so the rerun ends inside `sin`.
            let h = x.sin();
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            h * 3.0 + 1.0
        },
        &x,
    );
    y.sum(Kind::Float).backward();
    assert_eq!(
        after_last_save.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the code after the last saving op ran again in backward"
    );
    let expected = x.cos() * 3.0;
    let diff = (x.grad() - expected).abs().max().double_value(&[]);
    assert!(diff <= 1e-6, "gradient differs by {diff}");
}

#[test]
fn gradients_for_chosen_inputs_reach_parameters_inside_a_segment() {
    let _turn = rng_turn();
    let vs = nn::VarStore::new(Device::Cpu);
    let layer = nn::linear(vs.root() / "l", 3, 2, Default::default());
    let x = Tensor::randn([5, 3], (Kind::Float, Device::Cpu));
    let plain = layer.forward(&x).tanh().sum(Kind::Float);
    let expected = Tensor::run_backward(&[plain], &[&layer.ws], false, false);
    let ws = layer.ws.shallow_clone();
    let y = tchmem::checkpoint::checkpoint(move |x| layer.forward(x).tanh(), &x);
    let got = Tensor::run_backward(&[y.sum(Kind::Float)], &[&ws], false, false);
    let diff = (&got[0] - &expected[0]).abs().max().double_value(&[]);
    assert!(diff <= 1e-6, "weight gradient differs by {diff}");
}

#[test]
fn an_input_modified_in_place_before_backward_is_a_clear_error() {
    let _turn = rng_turn();
    let leaf = Tensor::randn([4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let mut input = &leaf * 2.0;
    let y = tchmem::checkpoint::checkpoint(|x| x.sin(), &input);
    let _ = input.g_add_scalar_(1.0);
    let err = y
        .sum(Kind::Float)
        .f_backward()
        .expect_err("the input changed");
    let message = err.to_string();
    assert!(message.contains("modified in place"), "{message}");
    assert!(!message.contains("Exception raised from"), "{message}");
}

#[test]
fn a_parameter_changed_between_forward_and_backward_is_a_clear_error() {
    let _turn = rng_turn();
    let vs = nn::VarStore::new(Device::Cpu);
    let layer = nn::linear(vs.root() / "l", 3, 3, Default::default());
    let mut ws = layer.ws.shallow_clone();
    // The input needs a gradient, so that the weight itself is saved for backward (only what
    // backward saves can be checked: a segment must not depend on state changed in between).
    let x = Tensor::randn([2, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let y = tchmem::checkpoint::checkpoint(move |x| layer.forward(x).tanh(), &x);
    tch::no_grad(|| {
        let _ = ws.g_add_scalar_(1.0);
    });
    let err = y
        .sum(Kind::Float)
        .f_backward()
        .expect_err("the weight changed");
    assert!(
        err.to_string().contains("modified in place between"),
        "{err}"
    );
}

#[test]
fn a_rerun_that_saves_other_tensors_is_a_clear_error() {
    let _turn = rng_turn();
    let x = Tensor::randn([4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = calls.clone();
    let y = tchmem::checkpoint::checkpoint(
        move |x| {
            if counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                x.sin()
            } else {
                x.slice(0, 0, 2, 1).sin()
            }
        },
        &x,
    );
    let err = y
        .sum(Kind::Float)
        .f_backward()
        .expect_err("the rerun differs");
    assert!(err.to_string().contains("saved different tensors"), "{err}");
}

#[test]
fn autograd_inside_a_segment_is_refused_not_deadlocked() {
    let _turn = rng_turn();
    let x = Tensor::randn([4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let result = std::panic::catch_unwind(|| {
        tchmem::checkpoint::checkpoint(
            |x| {
                let y = x.sin();
                let g = Tensor::run_backward(&[y.sum(Kind::Float)], &[x], true, false);
                &y + &g[0]
            },
            &x,
        )
    });
    let text = panic_text(result.expect_err("refused"));
    assert!(text.contains("not supported"), "{text}");
}

/// A checkpointed MLP whose segments keep their inputs as `keep` says.
fn mlp_kept(root: nn::Path, keep: tchmem::checkpoint::Keep) -> Box<dyn ModuleT> {
    let mut model = mlp_seq_for_keep(root);
    if keep.offload {
        model = model.offload();
    }
    if let Some(compression) = keep.compression {
        model = model.compress(compression);
    }
    Box::new(model)
}

fn mlp_seq_for_keep(root: nn::Path) -> tchmem::checkpoint::SequentialT {
    let dims = [16, 64, 64, 64, 64, 8];
    let mut model = tchmem::checkpoint::seq_t().segments(4);
    for (i, pair) in dims.windows(2).enumerate() {
        model = model
            .add(nn::linear(&root / i, pair[0], pair[1], Default::default()))
            .add_fn(|x| x.gelu("none"))
            .add_fn_t(|x, train| x.dropout(0.3, train));
    }
    model
}

#[test]
fn offloaded_segment_inputs_give_the_same_gradients_to_the_bit() {
    use tchmem::checkpoint::Keep;
    let _turn = rng_turn();
    let run = |keep: Keep| {
        tch::manual_seed(3);
        let vs = nn::VarStore::new(Device::Cpu);
        let model = mlp_kept(vs.root(), keep);
        let x = Tensor::randn([32, 16], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let mut grads = gradients(&vs, model.as_ref(), &x, 11);
        grads.push(("input".into(), x.grad().copy()));
        grads
    };
    let kept = run(Keep::default());
    let offloaded = run(Keep {
        offload: true,
        compression: None,
    });
    assert_eq!(max_abs_diff(&kept, &offloaded), 0.0);
}

/// The gradient of `w` in `sum(x * w)` is the input the rerun saw: `x` as the stored input
/// gives it back.
fn rerun_input(x: &Tensor, keep: tchmem::checkpoint::Keep) -> Tensor {
    let w = Tensor::ones(x.size(), (x.kind(), x.device())).set_requires_grad(true);
    let w_in = w.shallow_clone();
    let y = tchmem::checkpoint::checkpoint_with(move |x| x * &w_in, x, keep);
    y.sum(Kind::Float).backward();
    w.grad().copy()
}

#[test]
fn int8_segment_inputs_are_off_by_at_most_half_a_step_of_their_row() {
    let _turn = rng_turn();
    use tchmem::checkpoint::{Compression, Keep};
    let x = Tensor::randn([6, 50], (Kind::Float, Device::Cpu)) * 3.0;
    for offload in [false, true] {
        let seen = rerun_input(
            &x,
            Keep {
                offload,
                compression: Some(Compression::Int8),
            },
        );
        let step = x.abs().amax([1], true) / 127.0;
        let error = (&seen - &x).abs();
        let worst = f64::try_from((&error - &step * 0.5).max()).unwrap();
        assert!(worst <= 1e-6, "an element is {worst:e} beyond half a step");
        assert!(
            f64::try_from(error.max()).unwrap() > 0.0,
            "nothing was quantized"
        );
    }
}

#[test]
fn fp8_segment_inputs_keep_three_bits_of_mantissa() {
    let _turn = rng_turn();
    use tchmem::checkpoint::{Compression, Keep};
    let x = Tensor::randn([6, 50], (Kind::Float, Device::Cpu));
    let seen = rerun_input(
        &x,
        Keep {
            offload: false,
            compression: Some(Compression::Fp8),
        },
    );
    // Relative rounding of e4m3: 2^-4; below its smallest normal, an absolute 2^-9 of the scale.
    let scale = x.abs().amax([1], true) / 448.0;
    let bound = x.abs() * 0.0625 + scale * 2f64.powi(-9);
    let worst = f64::try_from(((&seen - &x).abs() - bound).max()).unwrap();
    assert!(worst <= 1e-6, "{worst:e}");
}

#[test]
fn compressed_and_offloaded_training_follows_the_kept_one() {
    use tchmem::checkpoint::{Compression, Keep};
    let _turn = rng_turn();
    let train = |keep: Keep| {
        tch::manual_seed(5);
        let vs = nn::VarStore::new(Device::Cpu);
        let model = mlp_kept(vs.root(), keep);
        let mut opt = nn::Adam::default().build(&vs, 1e-2).unwrap();
        let x = Tensor::randn([64, 16], (Kind::Float, Device::Cpu));
        let target = x.narrow(1, 0, 8).sin();
        let loss = |train| {
            (model.forward_t(&x, train) - &target)
                .square()
                .mean(Kind::Float)
        };
        let first = f64::try_from(loss(false)).unwrap();
        for _ in 0..60 {
            opt.backward_step(&loss(true));
        }
        (first, f64::try_from(loss(false)).unwrap())
    };
    let (first, kept) = train(Keep::default());
    let (_, rounded) = train(Keep {
        offload: true,
        compression: Some(Compression::Int8),
    });
    assert!(
        kept < 0.8 * first,
        "the kept model did not learn: {first} → {kept}"
    );
    assert!(
        (rounded - kept).abs() <= 0.1 * kept,
        "int8 inputs: {rounded}, kept: {kept}"
    );
}

/// Under CPU autocast on a CPU whose oneDNN lacks the dtype, `autocast_on` turns oneDNN off
/// (see tests/amp.rs); the rerun in backward, after that autocast has ended, must run the LSTM
/// with the same kernels, or oneDNN fails on bf16 there (and elsewhere saves other tensors).
#[test]
fn an_lstm_segment_reruns_in_backward_as_it_ran_under_cpu_autocast() {
    use nn::RNN;
    let _turn = rng_turn();
    let vs = nn::VarStore::new(Device::Cpu);
    // Tensors are Send but not Sync: the segment shares the LSTM through a Mutex.
    let lstm = std::sync::Arc::new(std::sync::Mutex::new(nn::lstm(
        vs.root() / "l",
        8,
        16,
        Default::default(),
    )));
    let x = Tensor::randn([4, 5, 8], (Kind::Float, Device::Cpu));
    let weights: Vec<Tensor> = vs.trainable_variables();
    let gradients = |checkpointed: bool| {
        let y = tchmem::amp::autocast_on(Device::Cpu, Kind::BFloat16, || {
            if checkpointed {
                let lstm = lstm.clone();
                tchmem::checkpoint::checkpoint(move |x| lstm.lock().unwrap().seq(x).0, &x)
            } else {
                lstm.lock().unwrap().seq(&x).0
            }
        });
        let loss = y.to_kind(Kind::Float).sum(Kind::Float);
        Tensor::run_backward(&[loss], &weights, false, false)
    };
    let plain = gradients(false);
    let rerun = gradients(true);
    // The same bf16 arithmetic, rounded apart: within bf16's precision of the largest.
    for (a, b) in plain.iter().zip(&rerun) {
        let diff = (a - b).abs().max().double_value(&[]);
        let scale = a.abs().max().double_value(&[]);
        assert!(
            diff <= 1e-2 * scale,
            "gradient differs by {diff} of {scale}"
        );
    }
}
