// change: line 10: --amp f16: a tchmem::amp::GradScaler (`grad_scaler`) is created after the optimizer `opt`
// change: lines 15–16: --amp f16: the forward pass and loss run under tchmem::amp::autocast(Half): matmuls and convolutions compute in f16, so their activations take half the memory; parameters, gradients and optimizer state stay f32
// change: line 19: --amp f16: grad_scaler.backward_step(&mut opt, &loss) replaces the step: it scales the loss so that f16 gradients do not underflow, unscales them, and skips the step when they overflow
// change: line 19: phases marked (tchmem::phase: forward, backward, optimizer step), so that the cell's record tells activations and optimizer state apart and %%memprofile shows the phases
// %%optimize --amp f16: rewritten by tchmem
use tch::nn::{Module, OptimizerConfig};
use tch::{nn, Device, Kind, Tensor};

let device = Device::cuda_if_available();
let vs = nn::VarStore::new(device);
let encoder = nn::seq()
    .add(nn::linear(vs.root() / "enc", 128, 32, Default::default()))
    .add_fn(|xs| xs.tanh());
let decoder = nn::linear(vs.root() / "dec", 32, 128, Default::default());
let mut opt = nn::RmsProp::default().build(&vs, 1e-3)?;
let mut grad_scaler = tchmem::amp::GradScaler::new(&vs);
let data = Tensor::randn([1024, 128], (Kind::Float, device));
let mut step = 0;
while step < 300 {
    let xs = data.narrow(0, (step % 16) * 64, 64);
    tchmem::phase::forward();
    let loss = tchmem::amp::autocast_on(
        (&vs).device(),
        tch::Kind::Half,
        || {
            let code = xs.apply(&encoder);
            let loss = decoder.forward(&code).mse_loss(&xs, tch::Reduction::Mean);
            loss
        },
    );
    tchmem::phase::backward();
    grad_scaler.backward_step(&mut opt, &loss);
    tchmem::phase::end();
    step += 1;
}
let reconstruction = decoder.forward(&data.apply(&encoder));
let final_loss = reconstruction.mse_loss(&data, tch::Reduction::Mean);
println!("final loss {:.5}", final_loss.double_value(&[]));
