// change: line 10: --optimizer adafactor: nn::RmsProp → tchmem::optim::Adafactor (factored second moments: rows + columns per matrix instead of rows × columns); same learning rate
// change: line 10: --step-in-backward: stepped in backward (`.in_backward()`): each parameter is updated as soon as its gradient is complete and the gradient freed, so the model's gradients never all live at once; `step()`/`zero_grad()` find nothing left
// change: line 19: phases marked (tchmem::phase: forward, backward, optimizer step), so that the cell's record tells activations and optimizer state apart and %%memprofile shows the phases
// %%optimize --optimizer adafactor --step-in-backward: rewritten by tchmem
use tch::nn::{Module, OptimizerConfig};
use tch::{nn, Device, Kind, Tensor};

let device = Device::cuda_if_available();
let vs = nn::VarStore::new(device);
let encoder = nn::seq()
    .add(nn::linear(vs.root() / "enc", 128, 32, Default::default()))
    .add_fn(|xs| xs.tanh());
let decoder = nn::linear(vs.root() / "dec", 32, 128, Default::default());
let mut opt = tchmem::optim::Adafactor::default()
    .build(&vs, 1e-3)
    .map(tchmem::optim::Optimizer::in_backward)?;
let data = Tensor::randn([1024, 128], (Kind::Float, device));
let mut step = 0;
while step < 300 {
    let xs = data.narrow(0, (step % 16) * 64, 64);
    tchmem::phase::forward();
    let code = xs.apply(&encoder);
    let loss = decoder.forward(&code).mse_loss(&xs, tch::Reduction::Mean);
    opt.zero_grad();
    tchmem::phase::backward();
    loss.backward();
    tchmem::phase::step();
    opt.step();
    tchmem::phase::end();
    step += 1;
}
let reconstruction = decoder.forward(&data.apply(&encoder));
let final_loss = reconstruction.mse_loss(&data, tch::Reduction::Mean);
println!("final loss {:.5}", final_loss.double_value(&[]));
