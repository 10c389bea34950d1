//! On CUDA, the techniques beyond PyTorch's built-in recipe give what their CPU tests promise:
//! offloaded segment inputs (side stream, pinned memory, prefetch) the same gradients to the bit
//! as kept ones; int8 ones within their bound; the fused loss the unfused gradients (f32, and
//! under bf16 autocast); the step in backward the same parameters as the ordinary step. Prints
//! one JSON line per check with the largest difference.
//!
//!     gpu_techniques

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use tchmem::checkpoint::{Compression, Keep};

fn max_difference(a: &[Tensor], b: &[Tensor]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| f64::try_from((x - y).abs().max().to_kind(Kind::Double)).unwrap())
        .fold(0.0, f64::max)
}

/// Gradients of a 12-block residual MLP (width 1024, 8×512 tokens) checkpointed per block,
/// with its segment inputs kept as `keep` says.
fn checkpointed_gradients(keep: Keep) -> Vec<Tensor> {
    tch::manual_seed(0);
    let device = Device::Cuda(0);
    let vs = nn::VarStore::new(device);
    let mut model = tchmem::checkpoint::seq().segments(12);
    if keep.offload {
        model = model.offload();
    }
    if let Some(c) = keep.compression {
        model = model.compress(c);
    }
    for i in 0..12 {
        let fc = nn::linear(vs.root() / i, 1024, 1024, Default::default());
        model = model.add_fn(move |x| x + fc.forward(x).gelu("none"));
    }
    let x = Tensor::randn([8, 512, 1024], (Kind::Float, device));
    model.forward(&x).square().mean(Kind::Float).backward();
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named.into_iter().map(|(_, t)| t.grad().copy()).collect()
}

fn fused_against_unfused(amp: Option<Kind>) -> f64 {
    tch::manual_seed(1);
    let device = Device::Cuda(0);
    let opts = (Kind::Float, device);
    let hidden = Tensor::randn([4, 1024, 768], opts).set_requires_grad(true);
    let weight = (Tensor::randn([50304, 768], opts) * 0.02).set_requires_grad(true);
    let targets = Tensor::randint(50304, [4, 1024], (Kind::Int64, device));
    let run = |fused: bool| {
        let loss = || {
            if fused {
                tchmem::fused_loss::linear_cross_entropy(&hidden, &weight, None, &targets)
            } else {
                hidden
                    .matmul(&weight.tr())
                    .view([-1, 50304])
                    .cross_entropy_for_logits(&targets.view([-1]))
            }
        };
        let loss = match amp {
            Some(kind) => tchmem::amp::autocast(kind, loss),
            None => loss(),
        };
        loss.backward();
        let out = vec![loss.detach(), hidden.grad().copy(), weight.grad().copy()];
        let _ = hidden.grad().zero_();
        let _ = weight.grad().zero_();
        out
    };
    let plain = run(false);
    let fused = run(true);
    // Relative to the largest gradient element, so that f32 and bf16 read alike.
    let scale = f64::try_from(plain[2].abs().max()).unwrap().max(1e-12);
    let loss_difference = max_difference(&plain[..1], &fused[..1]);
    let grad_difference = max_difference(&plain[1..], &fused[1..]) / scale;
    loss_difference.max(grad_difference)
}

fn in_backward_against_ordinary() -> f64 {
    let train = |in_backward: bool| {
        tch::manual_seed(2);
        let device = Device::Cuda(0);
        let vs = nn::VarStore::new(device);
        let a = nn::linear(vs.root() / "a", 512, 2048, Default::default());
        let b = nn::linear(vs.root() / "b", 2048, 512, Default::default());
        let opt = tchmem::optim::AdamW::from(nn::AdamW::default())
            .build(&vs, 1e-3)
            .unwrap();
        let mut ordinary = (!in_backward).then(|| {
            tchmem::optim::AdamW::from(nn::AdamW::default())
                .build(&vs, 1e-3)
                .unwrap()
        });
        let mut hooked = in_backward.then(|| opt.in_backward());
        for step in 0..3 {
            tch::manual_seed(10 + step);
            let x = Tensor::randn([256, 512], (Kind::Float, device));
            let loss = (b.forward(&a.forward(&x).gelu("none")) - &x)
                .square()
                .mean(Kind::Float);
            match (&mut ordinary, &mut hooked) {
                (Some(o), _) => o.backward_step(&loss),
                (_, Some(h)) => h.backward_step(&loss),
                _ => unreachable!(),
            }
        }
        let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        named.into_iter().map(|(_, t)| t.copy()).collect::<Vec<_>>()
    };
    max_difference(&train(false), &train(true))
}

fn main() {
    assert!(tch::Cuda::is_available(), "needs CUDA");
    let kept = checkpointed_gradients(Keep::default());
    let offloaded = checkpointed_gradients(Keep {
        offload: true,
        compression: None,
    });
    let int8 = checkpointed_gradients(Keep {
        offload: true,
        compression: Some(Compression::Int8),
    });
    let scale = kept
        .iter()
        .map(|g| f64::try_from(g.abs().max()).unwrap())
        .fold(0.0, f64::max);
    let checks = [
        (
            "offload: gradients against kept inputs",
            max_difference(&kept, &offloaded),
        ),
        (
            "offload+int8: gradients against kept inputs, relative to the largest",
            max_difference(&kept, &int8) / scale,
        ),
        (
            "fused loss f32: loss and gradients",
            fused_against_unfused(None),
        ),
        (
            "fused loss bf16 autocast: loss and gradients",
            fused_against_unfused(Some(Kind::BFloat16)),
        ),
        (
            "step in backward: parameters after 3 AdamW steps",
            in_backward_against_ordinary(),
        ),
    ];
    for (check, difference) in checks {
        println!(
            "{}",
            serde_json::json!({"check": check, "max_difference": difference})
        );
    }
}
