// change: line 11: --checkpoint: nn::seq() → tchmem::checkpoint::seq() (√layers segments): activations inside each segment are recomputed in the backward pass instead of being kept
// change: line 11: --offload: `.offload()`: each segment's input (all checkpointing keeps) goes to pinned host memory on a side stream once the segment has run, and comes back one segment ahead of its rerun in backward
// change: line 18: --step-in-backward: nn::AdamW → tchmem::optim::AdamW::from(…) (the same settings), stepped in backward (`.in_backward()`): each parameter is updated as soon as its gradient is complete and the gradient freed, so the model's gradients never all live at once; `step()`/`zero_grad()` find nothing left
// change: line 28: --fused-loss: the head `head` and the cross-entropy → tchmem::fused_loss (64 tokens per chunk): the loss and its gradients computed chunk by chunk in the forward pass, no logits tensor in forward or backward
// change: line 29: phases marked (tchmem::phase: forward, backward, optimizer step), so that the cell's record tells activations and optimizer state apart and %%memprofile shows the phases
// %%optimize --checkpoint --offload --fused-loss 64 --step-in-backward: rewritten by tchmem
use tch::nn::{Module, OptimizerConfig};
use tch::{nn, Device, Kind, Tensor};

const VOCAB: i64 = 512;
const WIDTH: i64 = 64;
let device = Device::cuda_if_available();
let vs = nn::VarStore::new(device);
let root = vs.root();
// A small language model whose output head is a layer of its own.
let embed = nn::embedding(&root / "embed", VOCAB, WIDTH, Default::default());
let body = tchmem::checkpoint::seq()
    .add(nn::linear(&root / "l1", WIDTH, 4 * WIDTH, Default::default()))
    .add_fn(|xs| xs.gelu("none"))
    .add(nn::linear(&root / "l2", 4 * WIDTH, WIDTH, Default::default()))
    .add_fn(|xs| xs.gelu("none"))
    .add(nn::linear(&root / "l3", WIDTH, WIDTH, Default::default()))
    .offload();
let head = nn::linear(&root / "head", WIDTH, VOCAB, Default::default());
let mut opt = tchmem::optim::AdamW::from(nn::AdamW::default())
    .build(&vs, 1e-3)
    .map(tchmem::optim::Optimizer::in_backward)?;

let tokens = Tensor::randint(VOCAB, [64, 33], (Kind::Int64, device));
for epoch in 1..=3 {
    let mut total = 0.0;
    for batch in tokens.split(16, 0).iter() {
        let xs = batch.narrow(1, 0, 32);
        let ys = batch.narrow(1, 1, 32);
        tchmem::phase::forward();
        let hidden = body.forward(&xs.apply(&embed));
        let loss = tchmem::fused_loss::FusedLoss::default()
            .chunk(64)
            .loss(&hidden, &head.ws, head.bs.as_ref(), &ys.reshape([-1]));
        tchmem::phase::backward();
        opt.zero_grad();
        loss.backward();
        tchmem::phase::step();
        opt.step();
        tchmem::phase::end();
        total += loss.double_value(&[]);
    }
    println!("epoch {epoch}: mean loss {:.4}", total / 4.0);
}
