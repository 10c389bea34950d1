//! The exact terms of a memory estimate match what the optimizers really keep (CPU).

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use tchmem::estimate::{shapes, tensor_bytes, OptimizerRule, ParamShape};
use tchmem::optim::{self, Optimizer};

/// Three linear layers and a layer norm: matrices large enough for AdamW8bit to quantize (8192
/// elements), and biases and norm weights small enough for it not to.
fn model(vs: &nn::VarStore) -> impl Module {
    let root = vs.root();
    nn::seq()
        .add(nn::linear(&root / "a", 64, 128, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&root / "b", 128, 64, Default::default()))
        .add(nn::layer_norm(&root / "norm", vec![64], Default::default()))
        .add(nn::linear(&root / "c", 64, 10, Default::default()))
}

/// Builds an optimizer over a store.
type Build = fn(&nn::VarStore) -> Optimizer;

/// The state `build`'s optimizer keeps after one real step over a fresh model, and the
/// model's trainable parameters.
fn one_step(build: impl Fn(&nn::VarStore) -> Optimizer) -> (u64, Vec<ParamShape>) {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = model(&vs);
    let mut opt = build(&vs);
    let x = Tensor::randn([16, 64], (Kind::Float, Device::Cpu));
    opt.backward_step(&net.forward(&x).square().mean(Kind::Float));
    (opt.state_bytes(), shapes(&vs))
}

#[test]
fn each_rule_gives_the_bytes_its_optimizer_keeps_after_a_step() {
    let cases: [(OptimizerRule, Build); 6] = [
        (OptimizerRule::Adam, |vs| {
            optim::Adam::default().build(vs, 1e-3).unwrap()
        }),
        (OptimizerRule::AdamW, |vs| {
            optim::AdamW::default().build(vs, 1e-3).unwrap()
        }),
        (OptimizerRule::Sgd { momentum: true }, |vs| {
            optim::Sgd::default().build(vs, 1e-2).unwrap()
        }),
        (OptimizerRule::Lion, |vs| {
            optim::Lion::default().build(vs, 1e-4).unwrap()
        }),
        (OptimizerRule::AdamW8bit, |vs| {
            optim::AdamW8bit::default().build(vs, 1e-3).unwrap()
        }),
        (OptimizerRule::Adafactor, |vs| {
            optim::Adafactor::default().build(vs, 1e-2).unwrap()
        }),
    ];
    for (rule, build) in cases {
        let (kept, shapes) = one_step(build);
        assert_eq!(
            shapes.len(),
            8,
            "3 weights, 3 biases, the norm's weight and bias"
        );
        assert!(kept > 0, "{}", rule.label());
        assert_eq!(rule.state_bytes(&shapes), kept, "{}", rule.label());
    }
}

#[test]
fn sgd_without_momentum_keeps_nothing() {
    let (kept, _) = one_step(|vs| {
        optim::Sgd {
            momentum: 0.0,
            ..Default::default()
        }
        .build(vs, 1e-2)
        .unwrap()
    });
    assert_eq!(kept, 0);
    assert_eq!(OptimizerRule::Sgd { momentum: false }.state_bytes(&[]), 0);
}

#[test]
fn parameter_bytes_are_those_of_the_trainable_variables() {
    let vs = nn::VarStore::new(Device::Cpu);
    let _net = model(&vs);
    // A frozen variable is no parameter an optimizer trains.
    let _frozen = vs.root().zeros_no_train("frozen", &[1000]);
    let trainable: u64 = vs
        .trainable_variables()
        .iter()
        .map(tchmem::tensor_bytes)
        .sum();
    let shapes = shapes(&vs);
    assert_eq!(shapes.len(), 8);
    assert_eq!(tensor_bytes(&shapes), trainable);
    assert_eq!(
        trainable,
        4 * (64 * 128 + 128 + 128 * 64 + 64 + 64 + 64 + 64 * 10 + 10)
    );
}
