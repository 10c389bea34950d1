// change: line 7: --checkpoint: nn::seq_t() → tchmem::checkpoint::seq_t() (√layers segments): activations inside each segment are recomputed in the backward pass instead of being kept
// change: line 19: --optimizer adamw8bit: nn::AdamW → tchmem::optim::AdamW8bit (8-bit moments: about a quarter of Adam's state); the settings given to nn::AdamW are not carried over: tchmem::optim::AdamW8bit's defaults apply; same learning rate
// change: line 19: --amp f16: a tchmem::amp::GradScaler (`grad_scaler`) is created after the optimizer `opt`
// change: lines 28–29: --amp f16: the forward pass and loss run under tchmem::amp::autocast(Half): matmuls and convolutions compute in f16, so their activations take half the memory; parameters, gradients and optimizer state stay f32
// change: lines 28–29: --accumulate 2: the batch (bx, by) runs as 2 micro-batches (tchmem::accumulate::split, along dim 0); each micro-batch's loss is weighted by its share of the batch, so the gradients add up to the whole batch's, and the optimizer steps once per batch; `loss` is the whole batch's loss, as before
// change: line 31: --amp f16: grad_scaler.step(&mut opt) replaces the step: it unscales the accumulated gradients and skips the step when they overflow
// change: line 31: phases marked (tchmem::phase: forward, backward, optimizer step), so that the cell's record tells activations and optimizer state apart and %%memprofile shows the phases
// %%optimize --checkpoint --amp f16 --accumulate 2 --optimizer adamw8bit: rewritten by tchmem
// Comments inside the rewritten statements (at line 23 of the cell) were dropped: the printer cannot keep them.
use tch::nn::{ModuleT, OptimizerConfig};
use tch::{nn, Device, Kind, Tensor};

let device = Device::cuda_if_available();
let vs = nn::VarStore::new(device);
let p = vs.root();
let net = tchmem::checkpoint::seq_t()
    .add(nn::linear(&p / "fc1", 512, 2048, Default::default()))
    .add_fn(|xs| xs.gelu("none"))
    .add_fn_t(|xs, train| xs.dropout(0.1, train))
    .add(nn::linear(&p / "fc2", 2048, 2048, Default::default()))
    .add_fn(|xs| xs.gelu("none"))
    .add_fn_t(|xs, train| xs.dropout(0.1, train))
    .add(nn::linear(&p / "fc3", 2048, 1, Default::default()));
let mut opt = tchmem::optim::AdamW8bit::default().build(&vs, 3e-4)?;
let mut grad_scaler = tchmem::amp::GradScaler::new(&vs);

let xs = Tensor::randn([4096, 512], (Kind::Float, device));
let ys = xs.sum_dim_intlist(1, true, Kind::Float).tanh();
for epoch in 0..10 {
    let mut batches = tch::data::Iter2::new(&xs, &ys, 128);
    for (bx, by) in batches.shuffle() {
        opt.zero_grad();
        let loss = {
            let mut accumulated: Option<tch::Tensor> = None;
            for (weight, [ref bx, ref by]) in tchmem::accumulate::split(
                2,
                [&bx, &by],
            ) {
                tchmem::phase::forward();
                let loss = tchmem::amp::autocast_on(
                    (&vs).device(),
                    tch::Kind::Half,
                    || {
                        let pred = net.forward_t(&bx, true);
                        let loss = pred.mse_loss(&by, tch::Reduction::Mean);
                        loss
                    },
                );
                let scaled = &loss * weight;
                tchmem::phase::backward();
                grad_scaler.scale(&scaled).backward();
                let part = scaled.detach();
                accumulated = Some(
                    match accumulated {
                        Some(sum) => sum + part,
                        None => part,
                    },
                );
            }
            accumulated.expect("an empty batch")
        };
        tchmem::phase::step();
        grad_scaler.step(&mut opt);
        tchmem::phase::end();
    }
    let test = net.forward_t(&xs, false).mse_loss(&ys, tch::Reduction::Mean);
    println!("epoch {epoch}: test mse {:.5}", test.double_value(& []));
}
