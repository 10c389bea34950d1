// change: lines 15–16: --accumulate 2: the batch (xs) runs as 2 micro-batches (tchmem::accumulate::split, along dim 0); each micro-batch's loss is weighted by its share of the batch, so the gradients add up to the whole batch's, and the optimizer steps once per batch; `loss` is the whole batch's loss, as before
// change: line 19: phases marked (tchmem::phase: forward, backward, optimizer step), so that the cell's record tells activations and optimizer state apart and %%memprofile shows the phases
// %%optimize --accumulate 2: rewritten by tchmem
use tch::nn::{Module, OptimizerConfig};
use tch::{nn, Device, Kind, Tensor};

let device = Device::cuda_if_available();
let vs = nn::VarStore::new(device);
let encoder = nn::seq()
    .add(nn::linear(vs.root() / "enc", 128, 32, Default::default()))
    .add_fn(|xs| xs.tanh());
let decoder = nn::linear(vs.root() / "dec", 32, 128, Default::default());
let mut opt = nn::RmsProp::default().build(&vs, 1e-3)?;
let data = Tensor::randn([1024, 128], (Kind::Float, device));
let mut step = 0;
while step < 300 {
    let xs = data.narrow(0, (step % 16) * 64, 64);
    opt.zero_grad();
    let loss = {
        let mut accumulated: Option<tch::Tensor> = None;
        for (weight, [ref xs]) in tchmem::accumulate::split(2, [&xs]) {
            tchmem::phase::forward();
            let code = xs.apply(&encoder);
            let loss = decoder.forward(&code).mse_loss(&xs, tch::Reduction::Mean);
            let scaled = &loss * weight;
            tchmem::phase::backward();
            scaled.backward();
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
    opt.step();
    tchmem::phase::end();
    step += 1;
}
let reconstruction = decoder.forward(&data.apply(&encoder));
let final_loss = reconstruction.mse_loss(&data, tch::Reduction::Mean);
println!("final loss {:.5}", final_loss.double_value(&[]));
