//! The optimizers of `tchmem::optim` against real libtorch on the CPU: they train, their state
//! bytes match the theory exactly, and their updates match hand-computed ones.

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use tchmem::optim::{Adafactor, Adam, AdamW, AdamW8bit, Lion, Optimizer, Sgd, Step};

mod common;
use common::rng_turn;

const CPU: Device = Device::Cpu;

/// A fixed random linear regression: a 64→32 linear model and its data.
struct Problem {
    vs: nn::VarStore,
    model: nn::Linear,
    x: Tensor,
    y: Tensor,
}

impl Problem {
    fn new() -> Problem {
        tch::manual_seed(0);
        let vs = nn::VarStore::new(CPU);
        let model = nn::linear(vs.root() / "l", 64, 32, Default::default());
        let x = Tensor::randn([256, 64], (Kind::Float, CPU));
        let w = Tensor::randn([64, 32], (Kind::Float, CPU)) * 0.3;
        let y = x.matmul(&w) + 0.01 * Tensor::randn([256, 32], (Kind::Float, CPU));
        Problem { vs, model, x, y }
    }

    fn loss(&self) -> Tensor {
        (self.model.forward(&self.x) - &self.y)
            .square()
            .mean(Kind::Float)
    }

    /// Initial and final loss after `steps` steps of `opt` built on this problem.
    fn train(&self, opt: &mut Optimizer, steps: usize) -> (f64, f64) {
        let initial = f64::try_from(self.loss()).unwrap();
        for _ in 0..steps {
            opt.backward_step(&self.loss());
        }
        (initial, f64::try_from(self.loss()).unwrap())
    }
}

type Builder = Box<dyn Fn(&nn::VarStore) -> Optimizer>;

/// A builder for each optimizer of the crate: SGD (lr 0.05), Lion (`lion_lr`), AdamW8bit and
/// Adafactor (lr 1e-2); `min_8bit_size` overrides AdamW8bit's (0: every parameter in 8 bits).
fn every_optimizer(lion_lr: f64, min_8bit_size: Option<usize>) -> Vec<Builder> {
    vec![
        Box::new(|vs| Sgd::default().build(vs, 0.05).unwrap()),
        Box::new(move |vs| Lion::default().build(vs, lion_lr).unwrap()),
        Box::new(move |vs| {
            let mut config = AdamW8bit::default();
            if let Some(size) = min_8bit_size {
                config.min_8bit_size = size;
            }
            config.build(vs, 1e-2).unwrap()
        }),
        Box::new(|vs| Adafactor::default().build(vs, 1e-2).unwrap()),
        Box::new(|vs| AdamW::default().build(vs, 1e-2).unwrap()),
    ]
}

fn assert_trains(build: impl FnOnce(&nn::VarStore) -> Optimizer) {
    let problem = Problem::new();
    let mut opt = build(&problem.vs);
    let (initial, last) = problem.train(&mut opt, 200);
    assert!(
        last < 0.5 * initial,
        "{}: loss {initial} → {last}",
        opt.name()
    );
}

#[test]
fn every_optimizer_decreases_the_loss() {
    let _turn = rng_turn();
    assert_trains(|vs| Sgd::default().build(vs, 0.05).unwrap());
    assert_trains(|vs| {
        Sgd {
            nesterov: true,
            wd: 1e-4,
            ..Default::default()
        }
        .build(vs, 0.05)
        .unwrap()
    });
    assert_trains(|vs| Lion::default().build(vs, 3e-3).unwrap());
    assert_trains(|vs| AdamW8bit::default().build(vs, 0.01).unwrap());
    // Quantize even this small model's moments.
    assert_trains(|vs| {
        AdamW8bit {
            min_8bit_size: 0,
            ..Default::default()
        }
        .build(vs, 0.01)
        .unwrap()
    });
    assert_trains(|vs| Adafactor::default().build(vs, 0.01).unwrap());
    assert_trains(|vs| {
        Adafactor {
            beta1: Some(0.9),
            ..Default::default()
        }
        .build(vs, 0.01)
        .unwrap()
    });
    assert_trains(|vs| {
        let config = Adafactor {
            relative_step: true,
            scale_parameter: true,
            ..Default::default()
        };
        config.build(vs, 0.0).unwrap()
    });
}

/// A model with a matrix, a 4-D kernel, a vector and a scalar; returns its store and a loss
/// that gives every parameter a gradient.
fn mixed_model() -> (nn::VarStore, Tensor) {
    tch::manual_seed(1);
    let vs = nn::VarStore::new(CPU);
    let root = vs.root();
    let w = root.randn("w", &[32, 64], 0.0, 0.1);
    let k = root.randn("k", &[8, 3, 5, 5], 0.0, 0.1);
    let b = root.randn("b", &[32], 0.0, 0.1);
    let s = root.randn("s", &[], 0.0, 0.1);
    let loss = w.square().sum(Kind::Float)
        + k.square().sum(Kind::Float)
        + b.square().sum(Kind::Float)
        + s.square();
    (vs, loss)
}

const MIXED_PARAMS: u64 = 32 * 64 + 8 * 3 * 5 * 5 + 32 + 1;

/// State bytes before and after one step.
fn state_bytes(opt: &mut Optimizer, loss: &Tensor) -> (u64, u64) {
    let before = opt.state_bytes();
    opt.backward_step(loss);
    (before, opt.state_bytes())
}

#[test]
fn sgd_and_lion_keep_one_f32_buffer_per_parameter() {
    let _turn = rng_turn();
    let (vs, loss) = mixed_model();
    let mut opt = Sgd::default().build(&vs, 0.1).unwrap();
    assert_eq!(state_bytes(&mut opt, &loss), (0, 4 * MIXED_PARAMS));

    let (vs, loss) = mixed_model();
    let mut opt = Sgd {
        momentum: 0.0,
        ..Default::default()
    }
    .build(&vs, 0.1)
    .unwrap();
    assert_eq!(state_bytes(&mut opt, &loss), (0, 0));

    let (vs, loss) = mixed_model();
    let mut opt = Lion::default().build(&vs, 0.1).unwrap();
    assert_eq!(state_bytes(&mut opt, &loss), (0, 4 * MIXED_PARAMS));
    assert_eq!(opt.name(), "Lion");
}

#[test]
fn adafactor_keeps_rows_and_columns() {
    let _turn = rng_turn();
    let factored = 4 * ((32 + 64) + (8 * 3 * 5 + 8 * 3 * 5));
    let unfactored = 4 * (32 + 1);
    let (vs, loss) = mixed_model();
    let mut opt = Adafactor::default().build(&vs, 0.1).unwrap();
    assert_eq!(state_bytes(&mut opt, &loss), (0, factored + unfactored));

    let (vs, loss) = mixed_model();
    let mut opt = Adafactor {
        beta1: Some(0.9),
        ..Default::default()
    }
    .build(&vs, 0.1)
    .unwrap();
    let (_, after) = state_bytes(&mut opt, &loss);
    assert_eq!(after, factored + unfactored + 4 * MIXED_PARAMS);
}

/// Bytes of AdamW8bit's state for parameters of these sizes (defaults: block 256, 8-bit from
/// 4096 elements).
fn adamw8bit_bytes(sizes: &[u64]) -> u64 {
    let quantized = |n: u64| 2 * n + 2 * 4 * n.div_ceil(256);
    let params: u64 = sizes
        .iter()
        .map(|&n| if n >= 4096 { quantized(n) } else { 8 * n })
        .sum();
    let tables = 4 * (256 + 255) * 2;
    params
        + if sizes.iter().any(|&n| n >= 4096) {
            tables
        } else {
            0
        }
}

#[test]
fn adamw8bit_state_is_exact_and_a_quarter_of_adam() {
    let _turn = rng_turn();
    let vs = nn::VarStore::new(CPU);
    let a = vs.root().randn("a", &[1000, 7], 0.0, 0.1); // 7000: 28 blocks, the last partial
    let b = vs.root().randn("b", &[4096], 0.0, 0.1); // exactly the threshold: 8-bit
    let c = vs.root().randn("c", &[4095], 0.0, 0.1); // just below: f32
    let loss = a.square().sum(Kind::Float) + b.square().sum(Kind::Float) + c.sum(Kind::Float);
    let mut opt = AdamW8bit::default().build(&vs, 1e-3).unwrap();
    assert_eq!(
        state_bytes(&mut opt, &loss),
        (0, adamw8bit_bytes(&[7000, 4096, 4095]))
    );
    // Later steps reuse the state.
    opt.backward_step(&(a.square().sum(Kind::Float) + b.sum(Kind::Float) + c.sum(Kind::Float)));
    assert_eq!(opt.state_bytes(), adamw8bit_bytes(&[7000, 4096, 4095]));

    // A 1M-parameter model: about a quarter of fp32 AdamW's 8 bytes per parameter.
    tch::manual_seed(2);
    let vs = nn::VarStore::new(CPU);
    let model = nn::linear(vs.root(), 1024, 1024, Default::default());
    let params = 1024 * 1024 + 1024;
    let mut opt = AdamW8bit::default().build(&vs, 1e-3).unwrap();
    let x = Tensor::randn([8, 1024], (Kind::Float, CPU));
    opt.backward_step(&model.forward(&x).square().mean(Kind::Float));
    let bytes = opt.state_bytes();
    assert_eq!(bytes, adamw8bit_bytes(&[1024 * 1024, 1024]));
    let ratio = bytes as f64 / (8 * params) as f64;
    assert!((ratio - 0.25).abs() < 0.25 * 0.03, "ratio {ratio}");
}

#[test]
fn lion_matches_a_hand_computed_update() {
    let _turn = rng_turn();
    let (beta1, beta2, wd, lr) = (0.9, 0.99, 0.1, 0.01);
    let vs = nn::VarStore::new(CPU);
    let init = [1.0f64, -2.0, 0.5, 3.0];
    let w = vs
        .root()
        .var_copy("w", &Tensor::from_slice(&init).to_kind(Kind::Float));
    let mut opt = Lion { beta1, beta2, wd }.build(&vs, lr).unwrap();
    let grads = [[0.5f64, -1.0, 0.0, 2.0], [-2.0, -0.05, 0.3, 0.1]];
    let (mut p, mut m) = (init, [0.0f64; 4]);
    for g in grads {
        // loss = Σ w·g has gradient g.
        opt.backward_step(&(&w * Tensor::from_slice(&g).to_kind(Kind::Float)).sum(Kind::Float));
        for i in 0..4 {
            let c = beta1 * m[i] + (1.0 - beta1) * g[i];
            let sign = if c > 0.0 {
                1.0
            } else if c < 0.0 {
                -1.0
            } else {
                0.0
            };
            p[i] = p[i] * (1.0 - lr * wd) - lr * sign;
            m[i] = beta2 * m[i] + (1.0 - beta2) * g[i];
        }
        let got = Vec::<f64>::try_from(w.to_kind(Kind::Double)).unwrap();
        for i in 0..4 {
            assert!(
                (got[i] - p[i]).abs() < 1e-6,
                "w[{i}] = {} ≠ {}",
                got[i],
                p[i]
            );
        }
    }
}

#[test]
fn adamw8bit_tracks_fp32_adamw() {
    let _turn = rng_turn();
    let (beta1, beta2, eps, wd, lr) = (0.9, 0.999, 1e-8, 0.01, 1e-3);
    let steps = 6;
    let n = 8192;
    tch::manual_seed(3);
    let init = Tensor::randn([n], (Kind::Float, CPU));
    let grads: Vec<Tensor> = (0..steps)
        .map(|_| Tensor::randn([n], (Kind::Float, CPU)) * Tensor::rand([n], (Kind::Float, CPU)))
        .collect();

    let vs = nn::VarStore::new(CPU);
    let w = vs.root().var_copy("w", &init);
    let mut opt = AdamW8bit {
        beta1,
        beta2,
        eps,
        wd,
        ..Default::default()
    }
    .build(&vs, lr)
    .unwrap();

    // Reference AdamW in f64.
    let mut p = init.to_kind(Kind::Double);
    let mut m = p.zeros_like();
    let mut v = p.zeros_like();
    for (t, g) in grads.iter().enumerate() {
        opt.backward_step(&(&w * g).sum(Kind::Float));
        let g = g.to_kind(Kind::Double);
        let t = t as i32 + 1;
        p *= 1.0 - lr * wd;
        m = m * beta1 + &g * (1.0 - beta1);
        v = v * beta2 + g.square() * (1.0 - beta2);
        let denom = (&v / (1.0 - beta2.powi(t))).sqrt() + eps;
        p -= &m / denom * (lr / (1.0 - beta1.powi(t)));

        let diff = (w.to_kind(Kind::Double) - &p).abs();
        let moved = lr * f64::from(t);
        let max = f64::try_from(diff.max()).unwrap();
        let mean = f64::try_from(diff.mean(Kind::Double)).unwrap();
        assert!(
            max < 0.1 * moved,
            "step {t}: max error {max} (moved ≤ {moved})"
        );
        assert!(
            mean < 0.01 * moved,
            "step {t}: mean error {mean} (moved ≤ {moved})"
        );
    }
    // It did move: the error bound is not trivially met.
    let moved = f64::try_from(
        (w.to_kind(Kind::Double) - init.to_kind(Kind::Double))
            .abs()
            .mean(Kind::Double),
    )
    .unwrap();
    assert!(moved > 0.2 * lr * steps as f64, "moved {moved}");
}

#[test]
fn zero_grad_frees_gradients_and_backward_step_works() {
    let _turn = rng_turn();
    let builders = every_optimizer(1e-3, None);
    for build in builders {
        let problem = Problem::new();
        let mut opt = build(&problem.vs);
        let params = problem.vs.trainable_variables();
        problem.loss().backward();
        assert!(params.iter().all(|p| p.grad().defined()));
        opt.zero_grad();
        assert!(params.iter().all(|p| !p.grad().defined()), "{}", opt.name());
        // Through the trait as well.
        problem.loss().backward();
        Step::zero_grad(&mut opt);
        assert!(params.iter().all(|p| !p.grad().defined()));

        let before = f64::try_from(problem.loss()).unwrap();
        opt.backward_step(&problem.loss());
        assert!(params.iter().all(|p| p.grad().defined()));
        assert!(
            f64::try_from(problem.loss()).unwrap() < before,
            "{}",
            opt.name()
        );
    }
}

#[test]
fn set_lr_changes_the_step_size() {
    let _turn = rng_turn();
    let vs = nn::VarStore::new(CPU);
    let w = vs
        .root()
        .var_copy("w", &Tensor::from_slice(&[1.0f32, -1.0, 2.0]));
    let mut opt = Lion::default().build(&vs, 0.01).unwrap();
    assert_eq!(opt.lr(), 0.01);
    let moved = |opt: &mut Optimizer| {
        let before = w.copy();
        opt.backward_step(&w.sum(Kind::Float));
        f64::try_from((&before - &w).abs().max()).unwrap()
    };
    assert!((moved(&mut opt) - 0.01).abs() < 1e-6);
    opt.set_lr(0.03);
    assert_eq!(opt.lr(), 0.03);
    assert!((moved(&mut opt) - 0.03).abs() < 1e-6);
}

#[test]
fn parameters_without_gradients_are_skipped() {
    let _turn = rng_turn();
    let builders = every_optimizer(1e-3, Some(0));
    for build in builders {
        let vs = nn::VarStore::new(CPU);
        let used = vs.root().randn("used", &[16, 16], 0.0, 1.0);
        let unused = vs.root().randn("unused", &[16, 16], 0.0, 1.0);
        let unused_before = unused.copy();
        let mut opt = build(&vs);
        // No gradient at all yet.
        opt.step();
        assert_eq!(opt.state_bytes(), 0);
        opt.backward_step(&used.square().sum(Kind::Float));
        assert!(!unused.grad().defined());
        assert!(unused.equal(&unused_before), "{}", opt.name());
        let one_param = opt.state_bytes();
        assert!(one_param > 0);
        // Its state covers only the used parameter: a second one doubles it.
        opt.backward_step(&(used.square().sum(Kind::Float) + unused.square().sum(Kind::Float)));
        let tables = if opt.name() == "AdamW8bit" {
            4 * (256 + 255) * 2
        } else {
            0
        };
        assert_eq!(
            opt.state_bytes() - tables,
            2 * (one_param - tables),
            "{}",
            opt.name()
        );
    }
}

#[test]
fn clipping_matches_tch() {
    let _turn = rng_turn();
    let vs = nn::VarStore::new(CPU);
    let a = vs.root().var_copy("a", &Tensor::from_slice(&[3.0f32, 0.0]));
    let b = vs.root().var_copy("b", &Tensor::from_slice(&[0.0f32, 4.0]));
    let mut opt = Sgd {
        momentum: 0.0,
        ..Default::default()
    }
    .build(&vs, 1.0)
    .unwrap();
    // No gradients: nothing to clip.
    assert_eq!(opt.clip_grad_norm(1.0), 0.0);
    // Gradients (3, 0) and (0, 4): global norm 5.
    let loss = || (a.square().sum(Kind::Float) + b.square().sum(Kind::Float)) / 2.0;
    opt.zero_grad();
    loss().backward();
    let norm = opt.clip_grad_norm(1.0);
    assert!((norm - 5.0).abs() < 1e-5);
    let clipped =
        f64::try_from(Tensor::stack(&[a.grad().norm(), b.grad().norm()], 0).norm()).unwrap();
    assert!((clipped - 1.0).abs() < 1e-4, "{clipped}");

    opt.zero_grad();
    loss().backward();
    opt.clip_grad_value(1.0);
    assert_eq!(Vec::<f32>::try_from(a.grad()).unwrap(), [1.0, 0.0]);
    assert_eq!(Vec::<f32>::try_from(b.grad()).unwrap(), [0.0, 1.0]);

    // backward_step_clip clips values before stepping (lr 1): a = (3, 0) − (1, 0).
    opt.backward_step_clip(&loss(), 1.0);
    assert_eq!(Vec::<f32>::try_from(&a).unwrap(), [2.0, 0.0]);
    opt.backward_step_clip_norm(&loss(), 1.0);
    let a_now = Vec::<f32>::try_from(&a).unwrap();
    // Gradients (2, 0) and (0, 3): norm √13.
    assert!(
        (a_now[0] - (2.0 - 2.0 / 13f32.sqrt())).abs() < 1e-5,
        "{a_now:?}"
    );
}

#[test]
fn half_precision_parameters_step() {
    let _turn = rng_turn();
    let builders = every_optimizer(1e-2, Some(0));
    for build in builders {
        let mut vs = nn::VarStore::new(CPU);
        let w = vs.root().randn("w", &[64, 80], 0.0, 1.0);
        vs.bfloat16();
        assert_eq!(w.kind(), Kind::BFloat16);
        let mut opt = build(&vs);
        let loss = || w.to_kind(Kind::Float).square().sum(Kind::Float);
        let before = f64::try_from(loss()).unwrap();
        for _ in 0..5 {
            opt.backward_step(&loss());
        }
        assert_eq!(w.kind(), Kind::BFloat16);
        assert!(f64::try_from(loss()).unwrap() < before, "{}", opt.name());
        let expected = match opt.name() {
            "Sgd" => 4 * 64 * 80,
            "Lion" => 2 * 64 * 80, // in the parameter's kind
            "AdamW8bit" => adamw8bit_bytes(&[64 * 80]),
            "AdamW" => 2 * 2 * 64 * 80 + 4, // both moments in the parameter's kind, an f32 step
            _ => 4 * (64 + 80),
        };
        assert_eq!(opt.state_bytes(), expected, "{}", opt.name());
    }
}

#[test]
fn variables_added_later_are_picked_up() {
    let _turn = rng_turn();
    let vs = nn::VarStore::new(CPU);
    let a = vs.root().randn("a", &[10], 0.0, 1.0);
    let mut opt = Sgd::default().build(&vs, 0.1).unwrap();
    let b = vs.root().randn("b", &[20], 0.0, 1.0);
    opt.backward_step(&(a.square().sum(Kind::Float) + b.square().sum(Kind::Float)));
    assert_eq!(opt.state_bytes(), 4 * 30);
    opt.zero_grad();
    assert!(!b.grad().defined());
}

#[test]
fn invalid_configs_are_errors() {
    let _turn = rng_turn();
    let vs = nn::VarStore::new(CPU);
    assert!(AdamW8bit {
        block_size: 0,
        ..Default::default()
    }
    .build(&vs, 1e-3)
    .is_err());
    assert!(Sgd {
        nesterov: true,
        momentum: 0.0,
        ..Default::default()
    }
    .build(&vs, 1e-3)
    .is_err());
    assert!(Adafactor {
        beta1: Some(1.5),
        ..Default::default()
    }
    .build(&vs, 1e-3)
    .is_err());
    assert!(Lion {
        beta1: -0.1,
        ..Default::default()
    }
    .build(&vs, 1e-3)
    .is_err());
}

/// Trains the problem for 6 steps with tch's optimizer and with ours; the largest parameter
/// difference after them.
fn difference_from_tch(
    tch_opt: impl Fn(&nn::VarStore) -> nn::Optimizer,
    ours: impl Fn(&nn::VarStore) -> Optimizer,
) -> f64 {
    let reference = Problem::new();
    let fused = Problem::new();
    let mut a = tch_opt(&reference.vs);
    let mut b = ours(&fused.vs);
    for _ in 0..6 {
        a.backward_step(&reference.loss());
        b.backward_step(&fused.loss());
    }
    let theirs = reference.vs.variables();
    fused
        .vs
        .variables()
        .iter()
        .map(|(name, p)| (p - &theirs[name]).abs().max().double_value(&[]))
        .fold(0.0, f64::max)
}

#[test]
fn fused_adam_and_adamw_match_tchs_optimizers() {
    let _turn = rng_turn();
    use tch::nn::OptimizerConfig;
    let lr = 1e-2;
    let adamw = difference_from_tch(
        |vs| nn::AdamW::default().build(vs, lr).unwrap(),
        |vs| AdamW::default().build(vs, lr).unwrap(),
    );
    assert!(adamw <= 1e-6, "AdamW differs from tch's by {adamw}");
    let adam_l2_amsgrad = difference_from_tch(
        |vs| {
            nn::Adam {
                wd: 0.1,
                amsgrad: true,
                ..Default::default()
            }
            .build(vs, lr)
            .unwrap()
        },
        |vs| {
            Adam {
                wd: 0.1,
                amsgrad: true,
                ..Default::default()
            }
            .build(vs, lr)
            .unwrap()
        },
    );
    assert!(
        adam_l2_amsgrad <= 1e-6,
        "Adam (L2, amsgrad) differs from tch's by {adam_l2_amsgrad}"
    );
    // Not vacuous: the parameters moved by far more than the tolerance.
    let moved = difference_from_tch(
        |vs| nn::Sgd::default().build(vs, 0.0).unwrap(),
        |vs| AdamW::default().build(vs, lr).unwrap(),
    );
    assert!(moved > 1e-3, "AdamW moved the parameters by only {moved}");
}

#[test]
fn fused_adamw_keeps_two_moments_and_a_step_per_parameter() {
    let _turn = rng_turn();
    let (vs, loss) = mixed_model();
    let mut opt = AdamW::default().build(&vs, 1e-3).unwrap();
    let parameters = vs.trainable_variables().len() as u64;
    assert_eq!(
        state_bytes(&mut opt, &loss),
        (0, 8 * MIXED_PARAMS + 4 * parameters)
    );
    assert_eq!(opt.name(), "AdamW");
}

/// min-gpt's groups: weights in group 1 (decayed), the bias in group 0 (not), built with
/// `nn::Path::set_group`; the loss of a linear regression through them.
fn grouped_problem() -> (nn::VarStore, impl Fn() -> Tensor) {
    tch::manual_seed(0);
    let vs = nn::VarStore::new(CPU);
    let w = vs.root().set_group(1).randn("w", &[64, 32], 0.0, 0.1);
    let b = vs.root().set_group(0).randn("b", &[32], 0.0, 0.1);
    let x = Tensor::randn([128, 64], (Kind::Float, CPU));
    let y = Tensor::randn([128, 32], (Kind::Float, CPU));
    (vs, move || {
        (x.matmul(&w) + &b - &y).square().mean(Kind::Float)
    })
}

#[test]
fn parameter_groups_take_their_own_weight_decay_and_learning_rate_as_in_tch() {
    let _turn = rng_turn();
    use tch::nn::OptimizerConfig;
    let (reference, reference_loss) = grouped_problem();
    let (ours, our_loss) = grouped_problem();
    let mut a = nn::AdamW::default().build(&reference, 1e-2).unwrap();
    let mut b = AdamW::default().build(&ours, 1e-2).unwrap();
    a.set_weight_decay_group(0, 0.0);
    a.set_weight_decay_group(1, 0.5);
    a.set_lr_group(1, 3e-2);
    b.set_weight_decay_group(0, 0.0);
    b.set_weight_decay_group(1, 0.5);
    b.set_lr_group(1, 3e-2);
    for _ in 0..5 {
        a.backward_step(&reference_loss());
        b.backward_step(&our_loss());
    }
    let theirs = reference.variables();
    for (name, p) in ours.variables() {
        let difference = (&p - &theirs[&name]).abs().max().double_value(&[]);
        assert!(
            difference <= 1e-6,
            "{name} differs from tch's by {difference}"
        );
    }

    // The no-decay group is not decayed: Lion with decay on group 1 only moves the bias as
    // Lion without decay does, and the weights differently.
    let lion = |decay_group: Option<f64>| {
        let (vs, loss) = grouped_problem();
        let mut opt = Lion {
            wd: 0.0,
            ..Default::default()
        }
        .build(&vs, 1e-2)
        .unwrap();
        if let Some(wd) = decay_group {
            opt.set_weight_decay(wd);
            opt.set_weight_decay_group(0, 0.0);
        }
        for _ in 0..3 {
            opt.backward_step(&loss());
        }
        vs.variables()
    };
    let (plain, grouped) = (lion(None), lion(Some(1.0)));
    assert!(plain["b"].equal(&grouped["b"]));
    assert!(!plain["w"].equal(&grouped["w"]));
}
