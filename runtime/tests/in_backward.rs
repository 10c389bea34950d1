//! The optimizer step in backward gives the parameters the ordinary step gives, for every
//! optimizer of `tchmem::optim`, and frees each gradient in backward (CPU, real libtorch).

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tchmem::optim::{Adafactor, Adam, AdamW, AdamW8bit, Lion, Optimizer, Sgd};

const CPU: Device = Device::Cpu;

mod common;
use common::rng_turn;

/// A two-layer net with a tied weight used twice (its gradient is the sum of two paths), and a
/// parameter group with its own learning rate and no weight decay.
struct Net {
    vs: nn::VarStore,
    first: nn::Linear,
    second: nn::Linear,
    shared: Tensor,
}

impl Net {
    fn new() -> Net {
        tch::manual_seed(0);
        let vs = nn::VarStore::new(CPU);
        let root = vs.root();
        let first = nn::linear(&root / "first", 32, 64, Default::default());
        let second = nn::linear(root.set_group(1) / "second", 64, 32, Default::default());
        let shared = root.randn("shared", &[32, 32], 0.0, 0.1);
        Net {
            vs,
            first,
            second,
            shared,
        }
    }

    fn loss(&self, step: i64) -> Tensor {
        tch::manual_seed(100 + step);
        let x = Tensor::randn([16, 32], (Kind::Float, CPU));
        let h = x.matmul(&self.shared).apply(&self.first).gelu("none");
        let y = self.second.forward(&h).matmul(&self.shared.tr());
        (y - &x).square().mean(Kind::Float)
    }

    fn parameters(&self) -> Vec<(String, Tensor)> {
        let mut named: Vec<_> = self.vs.variables().into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        named
    }
}

type Builder = fn(&nn::VarStore) -> Optimizer;

fn builders() -> Vec<(&'static str, Builder)> {
    vec![
        ("Sgd", |vs| {
            Sgd {
                momentum: 0.9,
                ..Default::default()
            }
            .build(vs, 0.05)
            .unwrap()
        }),
        ("Lion", |vs| Lion::default().build(vs, 1e-3).unwrap()),
        ("AdamW8bit", |vs| {
            AdamW8bit {
                min_8bit_size: 0,
                ..Default::default()
            }
            .build(vs, 1e-2)
            .unwrap()
        }),
        ("Adafactor", |vs| {
            Adafactor::default().build(vs, 1e-2).unwrap()
        }),
        ("Adam", |vs| Adam::default().build(vs, 1e-2).unwrap()),
        ("AdamW", |vs| AdamW::default().build(vs, 1e-2).unwrap()),
        ("AdamW from tch's config", |vs| {
            AdamW::from(nn::AdamW::default()).build(vs, 1e-2).unwrap()
        }),
    ]
}

#[test]
fn every_optimizer_steps_in_backward_to_the_same_parameters() {
    let _turn = rng_turn();
    for (name, build) in builders() {
        let ordinary = Net::new();
        let mut opt = build(&ordinary.vs);
        opt.set_lr_group(1, 3e-3);
        opt.set_weight_decay_group(1, 0.0);
        for step in 0..3 {
            opt.backward_step(&ordinary.loss(step));
        }

        let hooked = Net::new();
        let mut opt = build(&hooked.vs).in_backward();
        opt.set_lr_group(1, 3e-3);
        opt.set_weight_decay_group(1, 0.0);
        for step in 0..3 {
            // The loop a user writes: backward, step, zero_grad.
            let loss = hooked.loss(step);
            loss.backward();
            for (param, value) in hooked.parameters() {
                assert!(
                    !value.grad().defined(),
                    "{name}: {param}'s gradient was kept"
                );
            }
            opt.step();
            opt.zero_grad();
        }
        for ((param, a), (_, b)) in ordinary.parameters().iter().zip(hooked.parameters()) {
            let difference = f64::try_from((a - &b).abs().max()).unwrap();
            assert!(
                difference == 0.0,
                "{name}: {param} differs by {difference:e}"
            );
        }
    }
}

#[test]
fn clipping_by_value_in_backward_gives_the_same_parameters_as_after_it() {
    let _turn = rng_turn();
    let train = |clip: Option<f64>, in_backward: bool| {
        let net = Net::new();
        let ordinary = || AdamW::default().build(&net.vs, 1e-2).unwrap();
        let mut plain = (!in_backward).then(ordinary);
        let mut hooked = in_backward.then(|| ordinary().in_backward());
        for step in 0..3 {
            let loss = net.loss(step);
            match (&mut plain, &mut hooked, clip) {
                (Some(opt), _, Some(max)) => opt.backward_step_clip(&loss, max),
                (Some(opt), _, None) => opt.backward_step(&loss),
                (_, Some(opt), Some(max)) => opt.backward_step_clip(&loss, max),
                (_, Some(opt), None) => opt.backward_step(&loss),
                _ => unreachable!(),
            }
        }
        net.parameters()
    };
    let differ = |a: &[(String, Tensor)], b: &[(String, Tensor)]| {
        a.iter()
            .zip(b)
            .map(|((_, x), (_, y))| f64::try_from((x - y).abs().max()).unwrap())
            .fold(0.0, f64::max)
    };
    // Clipped so hard that every gradient is cut (AdamW's update is scale-free, so the
    // difference shows through the moments' ratio of clipped elements).
    let clipped = train(Some(1e-4), false);
    assert_eq!(differ(&clipped, &train(Some(1e-4), true)), 0.0);
    assert!(differ(&clipped, &train(None, false)) > 0.0);
}

#[test]
fn a_newer_optimizer_over_the_same_parameters_keeps_its_hooks_when_the_old_one_goes() {
    let _turn = rng_turn();
    let net = Net::new();
    let old = Sgd::default().build(&net.vs, 0.1).unwrap().in_backward();
    let mut new = Sgd::default().build(&net.vs, 0.1).unwrap().in_backward();
    drop(old); // as a notebook drops a variable it shadows, after the new one exists
    let before = net.first.ws.copy();
    new.backward_step(&net.loss(0));
    assert!(f64::try_from((&net.first.ws - before).abs().max()).unwrap() > 0.0);
}

#[test]
fn a_dropped_optimizer_stops_stepping_and_gradients_stay() {
    let _turn = rng_turn();
    let net = Net::new();
    drop(Sgd::default().build(&net.vs, 0.1).unwrap().in_backward());
    let before = net.first.ws.copy();
    net.loss(0).backward();
    assert!(net.first.ws.grad().defined());
    assert!(f64::try_from((&net.first.ws - before).abs().max()).unwrap() == 0.0);
}

#[test]
fn tchs_own_optimizer_still_trains_the_store_after_one_in_backward_went() {
    let _turn = rng_turn();
    let net = Net::new();
    drop(AdamW::default().build(&net.vs, 1e-2).unwrap().in_backward());
    let mut opt = nn::AdamW::default().build(&net.vs, 1e-2).unwrap();
    let first = f64::try_from(net.loss(0)).unwrap();
    for _ in 0..20 {
        opt.backward_step(&net.loss(0));
    }
    assert!(f64::try_from(net.loss(0)).unwrap() < first);
}

#[test]
fn a_frozen_parameter_is_left_alone_and_hooked_once_it_trains_again() {
    let _turn = rng_turn();
    let net = Net::new();
    let _ = net.shared.shallow_clone().set_requires_grad(false);
    let mut opt = Sgd::default().build(&net.vs, 0.1).unwrap().in_backward();
    let (first, shared) = (net.first.ws.copy(), net.shared.copy());
    opt.backward_step(&net.loss(0));
    assert!(f64::try_from((&net.first.ws - first).abs().max()).unwrap() > 0.0);
    assert_eq!(
        f64::try_from((&net.shared - &shared).abs().max()).unwrap(),
        0.0
    );
    let _ = net.shared.shallow_clone().set_requires_grad(true);
    opt.backward_step(&net.loss(1));
    assert!(f64::try_from((&net.shared - shared).abs().max()).unwrap() > 0.0);
    assert!(!net.shared.grad().defined(), "its gradient was kept");
}
