// change: line 6: --checkpoint: nn::seq() → tchmem::checkpoint::seq() (√layers segments): activations inside each segment are recomputed in the backward pass instead of being kept
// change: line 10: --optimizer sgd: nn::RmsProp → tchmem::optim::Sgd (momentum 0.9: one f32 state tensor per parameter, Adam keeps two); same learning rate (SGD often wants a larger one than Adam: tune it)
// change: line 10: --amp f16: a tchmem::amp::GradScaler (`grad_scaler`) is created after the optimizer `opt`
// change: lines 15–16: --amp f16: the forward pass and loss run under tchmem::amp::autocast(Half): matmuls and convolutions compute in f16, so their activations take half the memory; parameters, gradients and optimizer state stay f32
// change: lines 15–16: --accumulate 4: the batch (xs) runs as 4 micro-batches (tchmem::accumulate::split, along dim 0); each micro-batch's loss is weighted by its share of the batch, so the gradients add up to the whole batch's, and the optimizer steps once per batch; `loss` is the whole batch's loss, as before
// change: line 19: --amp f16: grad_scaler.step(&mut opt) replaces the step: it unscales the accumulated gradients and skips the step when they overflow
// change: line 19: phases marked (tchmem::phase: forward, backward, optimizer step), so that the cell's record tells activations and optimizer state apart and %%memprofile shows the phases
// %%optimize --checkpoint --amp f16 --accumulate 4 --optimizer sgd: rewritten by tchmem
use tch::nn::{Module, OptimizerConfig};
use tch::{nn, Device, Kind, Tensor};

let device = Device::cuda_if_available();
let vs = nn::VarStore::new(device);
let encoder = tchmem::checkpoint::seq()
    .add(nn::linear(vs.root() / "enc", 128, 32, Default::default()))
    .add_fn(|xs| xs.tanh());
let decoder = nn::linear(vs.root() / "dec", 32, 128, Default::default());
let mut opt = tchmem::optim::Sgd::default().build(&vs, 1e-3)?;
let mut grad_scaler = tchmem::amp::GradScaler::new(&vs);
let data = Tensor::randn([1024, 128], (Kind::Float, device));
let mut step = 0;
while step < 300 {
    let xs = data.narrow(0, (step % 16) * 64, 64);
    opt.zero_grad();
    let loss = {
        let mut accumulated: Option<tch::Tensor> = None;
        for (weight, [ref xs]) in tchmem::accumulate::split(4, [&xs]) {
            tchmem::phase::forward();
            let loss = tchmem::amp::autocast_on(
                (&vs).device(),
                tch::Kind::Half,
                || {
                    let code = xs.apply(&encoder);
                    let loss = decoder
                        .forward(&code)
                        .mse_loss(&xs, tch::Reduction::Mean);
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
    step += 1;
}
let reconstruction = decoder.forward(&data.apply(&encoder));
let final_loss = reconstruction.mse_loss(&data, tch::Reduction::Mean);
println!("final loss {:.5}", final_loss.double_value(&[]));
