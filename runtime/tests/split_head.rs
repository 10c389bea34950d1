//! A head marked inside a model is the head everywhere but inside `split_head`, where the fused
//! loss takes it apart (CPU, real libtorch): a `nn::seq_t` ending in a `SplitHead`, a
//! `nn::func_t` closure with a tied head, and the misuses `split_head` refuses.

use tch::nn::{self, Module, ModuleT, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tchmem::fused_loss::{split_head, tied_head, FusedLoss, SplitHead};

mod common;
use common::rng_turn;

const WIDTH: i64 = 12;
const VOCAB: i64 = 29;

fn grads(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut all: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .map(|(name, t)| (name, t.grad().copy()))
        .collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    all
}

fn max_difference(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> f64 {
    a.iter()
        .zip(b)
        .map(|((_, x), (_, y))| f64::try_from((x - y).abs().max()).unwrap())
        .fold(0.0, f64::max)
}

fn zero_grads(vs: &nn::VarStore) {
    for (_, t) in vs.variables() {
        let mut grad = t.grad();
        if grad.defined() {
            let _ = grad.zero_();
        }
    }
}

#[test]
fn a_seq_ending_in_a_split_head_gives_the_unfused_loss_and_gradients() {
    let _turn = rng_turn();
    tch::manual_seed(3);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let p = vs.root();
    let model = nn::seq_t()
        .add(nn::linear(&p / "body", 8, WIDTH, Default::default()))
        .add_fn(|xs| xs.gelu("none"))
        .add(SplitHead(nn::linear(
            &p / "head",
            WIDTH,
            VOCAB,
            Default::default(),
        )));
    vs.set_kind(Kind::Double);
    let xs = Tensor::randn([4, 5, 8], (Kind::Double, Device::Cpu));
    let ys = Tensor::randint(VOCAB, [4, 5], (Kind::Int64, Device::Cpu));

    // Outside split_head the head runs: logits.
    let logits = model.forward_t(&xs, true);
    assert_eq!(logits.size(), [4, 5, VOCAB]);
    // tch's cross_entropy_for_logits takes the softmax in f32; the fused loss in f64 here.
    let loss = logits
        .view([-1, VOCAB])
        .log_softmax(-1, Kind::Double)
        .nll_loss(&ys.view([-1]));
    loss.backward();
    let expected = grads(&vs);

    zero_grads(&vs);
    let split = split_head(|| model.forward_t(&xs, true));
    assert_eq!(split.hidden.size(), [4, 5, WIDTH]);
    assert!(split.bias.is_some());
    let fused = FusedLoss::default().chunk(3).loss_of(&split, &ys);
    assert!(f64::try_from((&fused - &loss).abs()).unwrap() <= 1e-10);
    fused.backward();
    let difference = max_difference(&grads(&vs), &expected);
    assert!(difference <= 1e-10, "gradients differ by {difference}");
    // And the head is a head again afterwards.
    assert_eq!(model.forward_t(&xs, false).size(), [4, 5, VOCAB]);
}

#[test]
fn a_tied_head_in_a_func_t_closure_trains_as_the_unfused_one() {
    let _turn = rng_turn();
    let run = |split: bool| {
        tch::manual_seed(5);
        let mut vs = nn::VarStore::new(Device::Cpu);
        let p = vs.root();
        let wte = nn::embedding(&p / "wte", VOCAB, WIDTH, Default::default());
        let ln = nn::layer_norm(&p / "ln", vec![WIDTH], Default::default());
        vs.set_kind(Kind::Double);
        let model = nn::func_t(move |xs, _train| {
            let h = xs.apply(&wte).apply(&ln);
            tied_head(&h, &wte.ws)
        });
        let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
        let xs = Tensor::randint(VOCAB, [3, 6], (Kind::Int64, Device::Cpu));
        for _ in 0..3 {
            let loss = if split {
                split_head(|| model.forward_t(&xs, true)).cross_entropy(&xs)
            } else {
                model
                    .forward_t(&xs, true)
                    .view([-1, VOCAB])
                    .log_softmax(-1, Kind::Double)
                    .nll_loss(&xs.view([-1]))
            };
            opt.backward_step(&loss);
        }
        let mut weights: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        weights.sort_by(|a, b| a.0.cmp(&b.0));
        weights
    };
    let difference = max_difference(&run(true), &run(false));
    assert!(difference <= 1e-10, "weights differ by {difference}");
}

fn panic_message(job: impl FnOnce() + std::panic::UnwindSafe) -> String {
    let payload = std::panic::catch_unwind(job).expect_err("expected a panic");
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

#[test]
fn split_head_refuses_a_model_without_a_marked_head_or_one_that_goes_on_after_it() {
    let _turn = rng_turn();
    let vs = nn::VarStore::new(Device::Cpu);
    let p = vs.root();
    let plain = nn::linear(&p / "plain", 4, 6, Default::default());
    let marked = SplitHead(nn::linear(&p / "marked", 4, 4, Default::default()));
    let xs = Tensor::randn([2, 4], (Kind::Float, Device::Cpu));

    let none = panic_message(|| {
        split_head(|| plain.forward(&xs));
    });
    assert!(none.contains("ran no head marked"), "{none}");
    let after = panic_message(|| {
        split_head(|| marked.forward(&xs).apply(&plain));
    });
    assert!(after.contains("went on after its head"), "{after}");
    let twice = panic_message(|| {
        split_head(|| marked.forward(&marked.forward(&xs)));
    });
    assert!(twice.contains("second output head"), "{twice}");
    // A head a closure holds, marked where it is applied: the same layer, the same weights.
    let outside = xs.apply(&SplitHead::of(&plain));
    assert!(f64::try_from((&outside - plain.forward(&xs)).abs().max()).unwrap() == 0.0);
    let split = split_head(|| xs.apply(&SplitHead::of(&plain)));
    assert_eq!(split.weight.data_ptr(), plain.ws.data_ptr());
    assert!(split.weight.requires_grad());
    // A refused split leaves heads as heads.
    assert_eq!(marked.forward(&xs).size(), [2, 4]);
    assert!(!split_head(|| marked.forward(&xs)).hidden.requires_grad());
}
