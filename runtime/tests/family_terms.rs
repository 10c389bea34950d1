//! The exact terms of an estimate for each model family of the corpus (CPU, real libtorch):
//! parameters and BatchNorm's running statistics (held, never trained) against counts worked out
//! from each architecture by hand, and the gradients and optimizer state a real step leaves
//! against the estimate's rules.

use tch::nn::{self, ModuleT};
use tch::{Device, Kind, Tensor};
use tchmem::estimate::{tensor_bytes, OptimizerRule};
use tchmem::optim::{self, Optimizer};

const F32: u64 = 4;

/// What the estimate counts for `vs`, and what one step of `rule`'s optimizer leaves: checks
/// parameters against `parameters` elements, frozen bytes against `frozen` elements, then the
/// gradients (one per parameter) and the optimizer's state against the rule.
fn check(
    family: &str,
    vs: &nn::VarStore,
    loss: impl Fn() -> Tensor,
    (parameters, frozen): (u64, u64),
    (rule, mut opt): (OptimizerRule, Optimizer),
) {
    let model = tchmem::estimate::model(&[vs]).0;
    assert_eq!(
        tensor_bytes(&model.trainable),
        F32 * parameters,
        "{family}: parameters"
    );
    assert_eq!(
        model.frozen_bytes,
        F32 * frozen,
        "{family}: held, not trained"
    );
    opt.backward_step(&loss());
    let gradients: u64 = vs
        .trainable_variables()
        .iter()
        .map(|t| tchmem::tensor_bytes(&t.grad()))
        .sum();
    assert_eq!(
        gradients,
        F32 * parameters,
        "{family}: one gradient per parameter"
    );
    assert_eq!(
        rule.state_bytes(&model.trainable),
        opt.state_bytes(),
        "{family}: {}'s state",
        rule.label()
    );
}

fn images(batch: i64, size: i64) -> Tensor {
    Tensor::rand([batch, 3, size, size], (Kind::Float, Device::Cpu))
}

fn labels(batch: i64, classes: i64) -> Tensor {
    Tensor::randint(classes, [batch], (Kind::Int64, Device::Cpu))
}

#[test]
fn resnet18_of_tch_vision() {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = tch::vision::resnet::resnet18(&vs.root(), 10);
    // torchvision's resnet18 has 11,689,512 parameters with 1000 classes; with 10 the head is
    // 512·10 + 10 instead of 512·1000 + 1000. BatchNorm's running mean and variance over its
    // 4,800 channels (64 + 4·64 + 4·128 + 128 + 4·256 + 256 + 4·512 + 512) are held, not trained.
    let parameters = 11_689_512 - (512 * 1000 + 1000) + (512 * 10 + 10);
    let (xs, ys) = (images(2, 32), labels(2, 10));
    let sgd = optim::Sgd::default().build(&vs, 0.05).unwrap();
    check(
        "resnet18",
        &vs,
        || net.forward_t(&xs, true).cross_entropy_for_logits(&ys),
        (parameters, 2 * 4_800),
        (OptimizerRule::Sgd { momentum: true }, sgd),
    );
}

#[test]
fn a_vgg_style_net_with_batch_norm() {
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let mut net = nn::seq_t();
    let mut expected = 0;
    let mut channels_in = 3;
    for (i, width) in [16i64, 32].into_iter().enumerate() {
        let conv = nn::ConvConfig {
            padding: 1,
            ..Default::default()
        };
        net = net
            .add(nn::conv2d(
                &root / format!("conv{i}"),
                channels_in,
                width,
                3,
                conv,
            ))
            .add(nn::batch_norm2d(
                &root / format!("bn{i}"),
                width,
                Default::default(),
            ))
            .add_fn(|x| x.relu().max_pool2d_default(2));
        expected += channels_in * width * 9 + width + 2 * width;
        channels_in = width;
    }
    let net = net.add_fn(|x| x.flatten(1, -1)).add(nn::linear(
        &root / "head",
        32 * 4 * 4,
        10,
        Default::default(),
    ));
    expected += 32 * 4 * 4 * 10 + 10;
    let (xs, ys) = (images(2, 16), labels(2, 10));
    let adamw = optim::AdamW::default().build(&vs, 1e-3).unwrap();
    check(
        "vgg",
        &vs,
        || net.forward_t(&xs, true).cross_entropy_for_logits(&ys),
        (expected as u64, 2 * (16 + 32)),
        (OptimizerRule::AdamW, adamw),
    );
}

#[test]
fn a_gru_language_model() {
    let (vocab, embed, hidden) = (65i64, 32i64, 64i64);
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let embedding = nn::embedding(&root / "embed", vocab, embed, Default::default());
    let gru = nn::gru(&root / "gru", embed, hidden, Default::default());
    let head = nn::linear(&root / "head", hidden, vocab, Default::default());
    // Three gates, each with input and hidden weights and two biases.
    let expected = vocab * embed
        + 3 * (hidden * embed + hidden * hidden + 2 * hidden)
        + hidden * vocab
        + vocab;
    let tokens = Tensor::randint(vocab, [2, 9], (Kind::Int64, Device::Cpu));
    let adam = optim::Adam::default().build(&vs, 1e-3).unwrap();
    check(
        "gru",
        &vs,
        || {
            let xs = tokens.narrow(1, 0, 8).apply(&embedding);
            let (out, _) = nn::RNN::seq(&gru, &xs);
            next_token_loss(&out.apply(&head), &tokens, vocab)
        },
        (expected as u64, 0),
        (OptimizerRule::Adam, adam),
    );
}

/// The loss of predicting each next token of `tokens` (two rows of 9) from `logits` over the
/// first 8.
fn next_token_loss(logits: &Tensor, tokens: &Tensor, vocab: i64) -> Tensor {
    logits
        .view([-1, vocab])
        .cross_entropy_for_logits(&tokens.narrow(1, 1, 8).reshape([-1]))
}

#[test]
fn a_transformer_whose_head_is_its_token_embedding() {
    let (vocab, width) = (97i64, 32i64);
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let tokens_in = nn::embedding(&root / "wte", vocab, width, Default::default());
    let norm = nn::layer_norm(&root / "ln", vec![width], Default::default());
    let mlp = nn::linear(&root / "mlp", width, width, Default::default());
    // The head is the embedding's weight again: counted once.
    let expected = vocab * width + 2 * width + width * width + width;
    let tokens = Tensor::randint(vocab, [2, 9], (Kind::Int64, Device::Cpu));
    let adamw = optim::AdamW::default().build(&vs, 1e-3).unwrap();
    check(
        "tied_gpt",
        &vs,
        || {
            let xs = tokens.narrow(1, 0, 8).apply(&tokens_in);
            let xs = &xs + xs.apply(&norm).apply(&mlp).gelu("none");
            next_token_loss(&xs.matmul(&tokens_in.ws.tr()), &tokens, vocab)
        },
        (expected as u64, 0),
        (OptimizerRule::AdamW, adamw),
    );
}

#[test]
fn a_variational_autoencoder_as_in_tch_rs() {
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let linear = |name: &str, i: i64, o: i64| nn::linear(&root / name, i, o, Default::default());
    let (fc1, fc21, fc22) = (
        linear("fc1", 784, 400),
        linear("fc21", 400, 20),
        linear("fc22", 400, 20),
    );
    let (fc3, fc4) = (linear("fc3", 20, 400), linear("fc4", 400, 784));
    let expected = (784 * 400 + 400) + 2 * (400 * 20 + 20) + (20 * 400 + 400) + (400 * 784 + 784);
    let xs = Tensor::rand([2, 784], (Kind::Float, Device::Cpu));
    let adam = optim::Adam::default().build(&vs, 1e-3).unwrap();
    check(
        "vae",
        &vs,
        || {
            let h = xs.apply(&fc1).relu();
            let (mu, logvar) = (h.apply(&fc21), h.apply(&fc22));
            let z = &mu + (&logvar * 0.5).exp() * mu.randn_like();
            let recon = z.apply(&fc3).relu().apply(&fc4).sigmoid();
            let bce = recon.binary_cross_entropy::<Tensor>(&xs, None, tch::Reduction::Sum);
            let kld: Tensor =
                (logvar.shallow_clone() + 1.0 - mu.square() - logvar.exp()).sum(Kind::Float) * -0.5;
            bce + kld
        },
        (expected as u64, 0),
        (OptimizerRule::Adam, adam),
    );
}
