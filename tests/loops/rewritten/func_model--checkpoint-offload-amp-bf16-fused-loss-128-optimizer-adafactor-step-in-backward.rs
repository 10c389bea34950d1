// change: line 18: --checkpoint: nn::seq() → tchmem::checkpoint::seq() (√layers segments): activations inside each segment are recomputed in the backward pass instead of being kept
// change: line 18: --offload: `.offload()`: each segment's input (all checkpointing keeps) goes to pinned host memory on a side stream once the segment has run, and comes back one segment ahead of its rerun in backward
// change: line 31: --checkpoint: nn::seq_t() → tchmem::checkpoint::seq_t() (√layers segments): activations inside each segment are recomputed in the backward pass instead of being kept
// change: line 31: --offload: `.offload()`: each segment's input (all checkpointing keeps) goes to pinned host memory on a side stream once the segment has run, and comes back one segment ahead of its rerun in backward
// change: line 47: --optimizer adafactor: nn::AdamW → tchmem::optim::Adafactor (factored second moments: rows + columns per matrix instead of rows × columns); same learning rate
// change: line 47: --step-in-backward: stepped in backward (`.in_backward()`): each parameter is updated as soon as its gradient is complete and the gradient freed, so the model's gradients never all live at once; `step()`/`zero_grad()` find nothing left
// change: lines 54–55: --amp bf16: the forward pass and loss run under tchmem::amp::autocast(BFloat16): matmuls and convolutions compute in bf16, so their activations take half the memory; parameters, gradients and optimizer state stay f32
// change: line 55: --fused-loss: the head inside `model` and the cross-entropy → tchmem::fused_loss (128 tokens per chunk): the loss and its gradients computed chunk by chunk in the forward pass, no logits tensor in forward or backward
// change: line 56: phases marked (tchmem::phase: forward, backward, optimizer step), so that the cell's record tells activations and optimizer state apart and %%memprofile shows the phases
// change: --fused-loss: `head`, the last layer of `model` → `gpt(…)`, marked with tchmem::fused_loss::SplitHead: it is the head as before everywhere, and inside `split_head` gives the fused loss its input and weights instead of the logits
// %%optimize --checkpoint --amp bf16 --optimizer adafactor --offload --fused-loss 128 --step-in-backward: rewritten by tchmem
use tch::nn::{ModuleT, OptimizerConfig};
use tch::{nn, Device, IndexOp, Kind, Tensor};

const VOCAB: i64 = 256;
const WIDTH: i64 = 32;
const BLOCK: i64 = 16;

fn linear_no_bias(p: nn::Path, in_dim: i64, out_dim: i64) -> nn::Linear {
    let config = nn::LinearConfig {
        bias: false,
        ..Default::default()
    };
    nn::linear(p, in_dim, out_dim, config)
}

fn block(p: nn::Path) -> impl ModuleT {
    let ln = nn::layer_norm(&p / "ln", vec![WIDTH], Default::default());
    let mlp = tchmem::checkpoint::seq()
        .add(nn::linear(&p / "fc", WIDTH, 4 * WIDTH, Default::default()))
        .add_fn(|xs| xs.gelu("none"))
        .add(nn::linear(&p / "proj", 4 * WIDTH, WIDTH, Default::default()))
        .offload();
    nn::func_t(move |xs, train| xs + xs.apply(&ln).apply(&mlp).dropout(0.1, train))
}

// A character model in the style of tch-rs's min-gpt: built by functions, its head inside.
fn gpt(p: nn::Path) -> impl ModuleT {
    let tok_emb = nn::embedding(&p / "tok_emb", VOCAB, WIDTH, Default::default());
    let pos_emb = p.zeros("pos_emb", &[1, BLOCK, WIDTH]);
    let ln_f = nn::layer_norm(&p / "ln_f", vec![WIDTH], Default::default());
    let head = linear_no_bias(&p / "head", WIDTH, VOCAB);
    let mut blocks = tchmem::checkpoint::seq_t().offload();
    for i in 0..2 {
        blocks = blocks.add(block(&p / i));
    }
    nn::func_t(move |xs, train| {
        let (_, t) = xs.size2().unwrap();
        (xs.apply(&tok_emb) + pos_emb.i((.., ..t, ..)))
            .apply_t(&blocks, train)
            .apply(&ln_f)
            .apply(&tchmem::fused_loss::SplitHead::of(&head))
    })
}

let device = Device::cuda_if_available();
let vs = nn::VarStore::new(device);
let model = gpt(vs.root() / "gpt");
let mut opt = tchmem::optim::Adafactor::default()
    .build(&vs, 3e-4)
    .map(tchmem::optim::Optimizer::in_backward)?;
let data = Tensor::randint(VOCAB, [64, BLOCK + 1], (Kind::Int64, device));
for epoch in 1..=3 {
    let mut total = 0.0;
    for batch in data.split(16, 0).iter() {
        let xs = batch.narrow(1, 0, BLOCK);
        let ys = batch.narrow(1, 1, BLOCK);
        tchmem::phase::forward();
        let loss = tchmem::amp::autocast_on(
            (&vs).device(),
            tch::Kind::BFloat16,
            || {
                let logits = tchmem::fused_loss::split_head(|| {
                    xs.apply_t(&model, true)
                });
                let loss = tchmem::fused_loss::FusedLoss::default()
                    .chunk(128)
                    .loss_of(&logits, &ys.reshape([-1]));
                loss
            },
        );
        tchmem::phase::backward();
        opt.backward_step_clip(&loss, 0.5);
        tchmem::phase::end();
        total += loss.double_value(&[]);
    }
    println!("epoch {epoch}: mean loss {:.4}", total / 4.0);
}
