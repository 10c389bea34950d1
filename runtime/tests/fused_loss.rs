//! The fused linear cross-entropy gives the unfused loss's value and gradients (CPU, real
//! libtorch): odd chunk sizes, ignored targets, a bias, a tied head, a scaled loss, autocast.

use tch::{Device, Kind, Tensor};
use tchmem::fused_loss::{self, FusedLoss};

const WIDTH: i64 = 16;
const VOCAB: i64 = 37;

struct Case {
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor,
    targets: Tensor,
}

/// Hidden states [3, 7, WIDTH], a head with a bias, targets with every fifth one ignored.
fn case(kind: Kind, seed: i64) -> Case {
    tch::manual_seed(seed);
    let opts = (kind, Device::Cpu);
    let leaf = |t: Tensor| t.set_requires_grad(true);
    let targets = Tensor::randint(VOCAB, [3, 7], (Kind::Int64, Device::Cpu));
    let ignored = Tensor::arange(21, (Kind::Int64, Device::Cpu))
        .remainder(5)
        .eq(0)
        .view([3, 7]);
    Case {
        hidden: leaf(Tensor::randn([3, 7, WIDTH], opts)),
        weight: leaf(Tensor::randn([VOCAB, WIDTH], opts) * 0.3),
        bias: leaf(Tensor::randn([VOCAB], opts) * 0.1),
        targets: targets.masked_fill(&ignored, fused_loss::IGNORE_INDEX),
    }
}

/// The loss and the gradients of hidden, weight and bias, after `loss * scale` backward.
fn run(case: &Case, scale: f64, loss: impl Fn(&Case) -> Tensor) -> Vec<Tensor> {
    for t in [&case.hidden, &case.weight, &case.bias] {
        let mut grad = t.grad();
        if grad.defined() {
            let _ = grad.zero_();
        }
    }
    let value = loss(case);
    (&value * scale).backward();
    vec![
        value.detach().to_kind(Kind::Double),
        case.hidden.grad().to_kind(Kind::Double),
        case.weight.grad().to_kind(Kind::Double),
        case.bias.grad().to_kind(Kind::Double),
    ]
}

fn unfused(case: &Case, softmax: Kind) -> Tensor {
    (case.hidden.matmul(&case.weight.tr()) + &case.bias)
        .view([-1, VOCAB])
        .log_softmax(-1, softmax)
        .nll_loss(&case.targets.view([-1]))
}

fn max_difference(a: &[Tensor], b: &[Tensor]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| f64::try_from((x - y).abs().max()).unwrap())
        .fold(0.0, f64::max)
}

#[test]
fn f64_gradients_equal_the_unfused_loss_for_any_chunk() {
    let case = case(Kind::Double, 1);
    let expected = run(&case, 1.0, |c| unfused(c, Kind::Double));
    for chunk in [
        None,
        Some(1),
        Some(3),
        Some(7),
        Some(20),
        Some(21),
        Some(1000),
    ] {
        let fused = FusedLoss {
            chunk,
            ..FusedLoss::default()
        };
        let got = run(&case, 1.0, |c| {
            fused.loss(&c.hidden, &c.weight, Some(&c.bias), &c.targets)
        });
        let difference = max_difference(&got, &expected);
        assert!(difference <= 1e-10, "chunk {chunk:?}: {difference:e}");
    }
}

#[test]
fn f32_gradients_equal_cross_entropy_for_logits() {
    let case = case(Kind::Float, 2);
    let expected = run(&case, 1.0, |c| {
        (c.hidden.matmul(&c.weight.tr()) + &c.bias)
            .view([-1, VOCAB])
            .cross_entropy_for_logits(&c.targets.view([-1]))
    });
    let got = run(&case, 1.0, |c| {
        FusedLoss::default()
            .chunk(5)
            .loss(&c.hidden, &c.weight, Some(&c.bias), &c.targets)
    });
    let difference = max_difference(&got, &expected);
    assert!(difference <= 1e-5, "{difference:e}");
}

#[test]
fn a_scaled_loss_scales_the_gradients() {
    let case = case(Kind::Double, 3);
    let expected = run(&case, 2.5, |c| unfused(c, Kind::Double));
    let got = run(&case, 2.5, |c| {
        fused_loss::linear_cross_entropy(&c.hidden, &c.weight, Some(&c.bias), &c.targets)
    });
    assert!(max_difference(&got, &expected) <= 1e-10);
}

#[test]
fn a_tied_head_gets_both_gradients() {
    // GPT's tied embeddings: the table embeds the tokens and is the output projection.
    tch::manual_seed(4);
    let table =
        (Tensor::randn([VOCAB, WIDTH], (Kind::Double, Device::Cpu)) * 0.2).set_requires_grad(true);
    let tokens = Tensor::randint(VOCAB, [4, 9], (Kind::Int64, Device::Cpu));
    let targets = tokens.roll([-1], [1]);
    let gradient = |fused: bool| {
        let mut grad = table.grad();
        if grad.defined() {
            let _ = grad.zero_();
        }
        let hidden = Tensor::embedding(&table, &tokens, -1, false, false).tanh();
        let loss = if fused {
            FusedLoss::default()
                .chunk(4)
                .loss(&hidden, &table, None, &targets)
        } else {
            hidden
                .matmul(&table.tr())
                .view([-1, VOCAB])
                .log_softmax(-1, Kind::Double)
                .nll_loss(&targets.view([-1]))
        };
        loss.backward();
        (loss.detach(), table.grad().copy())
    };
    let (plain_loss, plain_grad) = gradient(false);
    let (fused_loss, fused_grad) = gradient(true);
    assert!(max_difference(&[fused_loss, fused_grad], &[plain_loss, plain_grad]) <= 1e-10);
}

#[test]
fn under_autocast_it_follows_the_unfused_head() {
    let case = case(Kind::Float, 5);
    let bf16 = |f: &dyn Fn() -> Tensor| tchmem::amp::autocast(Kind::BFloat16, f);
    let expected = run(&case, 1.0, |c| {
        bf16(&|| {
            (c.hidden.matmul(&c.weight.tr()) + &c.bias)
                .view([-1, VOCAB])
                .cross_entropy_for_logits(&c.targets.view([-1]))
        })
    });
    let got = run(&case, 1.0, |c| {
        bf16(&|| fused_loss::linear_cross_entropy(&c.hidden, &c.weight, Some(&c.bias), &c.targets))
    });
    // Both round the matmuls to bf16 (8 bits of mantissa); f32 alone would agree to 1e-6.
    let difference = max_difference(&got, &expected);
    assert!(difference <= 2e-2, "{difference:e}");
    assert_eq!(got[1].size(), vec![3, 7, WIDTH]);
}

#[test]
fn shapes_that_do_not_fit_are_refused_with_what_was_expected() {
    let case = case(Kind::Float, 6);
    let wrong = Tensor::randn([VOCAB, WIDTH + 1], (Kind::Float, Device::Cpu));
    let error = FusedLoss::default()
        .try_loss(&case.hidden, &wrong, None, &case.targets)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("the weight must be [vocabulary, 16]"),
        "{error}"
    );
    let few = case.targets.narrow(1, 0, 6);
    let error = FusedLoss::default()
        .try_loss(&case.hidden, &case.weight, None, &few)
        .unwrap_err()
        .to_string();
    assert!(error.contains("21 hidden states but 18 targets"), "{error}");
    let error = FusedLoss::default()
        .chunk(0)
        .try_loss(&case.hidden, &case.weight, None, &case.targets)
        .unwrap_err()
        .to_string();
    assert!(error.contains("at least 1"), "{error}");
}

#[test]
fn a_second_backward_through_one_loss_says_why_it_cannot() {
    let case = case(Kind::Float, 7);
    let loss = fused_loss::linear_cross_entropy(&case.hidden, &case.weight, None, &case.targets);
    let twice = &loss + &loss * 0.0;
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| twice.backward()));
    // One loss node, reached through two paths: autograd adds the paths' gradients before it
    // runs the node, once.
    assert!(result.is_ok());
    let again = Tensor::f_run_backward(&[&loss], &[&case.hidden], true, false);
    let message = match again {
        Ok(_) => panic!("a second backward went through"),
        Err(e) => e.to_string(),
    };
    assert!(message.contains("backward ran twice"), "{message}");
}

#[test]
fn all_targets_ignored_give_a_nan_loss_and_zero_gradients_as_nll_loss_does() {
    let case = case(Kind::Double, 8);
    let ignored = case.targets.full_like(fused_loss::IGNORE_INDEX);
    let loss =
        fused_loss::linear_cross_entropy(&case.hidden, &case.weight, Some(&case.bias), &ignored);
    assert!(f64::try_from(&loss).unwrap().is_nan());
    loss.backward();
    for grad in [case.hidden.grad(), case.weight.grad(), case.bias.grad()] {
        assert_eq!(f64::try_from(grad.abs().max()).unwrap(), 0.0);
    }
}

#[test]
fn under_no_grad_the_loss_is_the_same_and_no_gradient_is_kept() {
    let case = case(Kind::Double, 9);
    let with_grad =
        fused_loss::linear_cross_entropy(&case.hidden, &case.weight, None, &case.targets);
    let evaluated = tch::no_grad(|| {
        fused_loss::linear_cross_entropy(&case.hidden, &case.weight, None, &case.targets)
    });
    assert!(!evaluated.requires_grad());
    assert_eq!(
        f64::try_from(&with_grad).unwrap(),
        f64::try_from(&evaluated).unwrap()
    );
}
