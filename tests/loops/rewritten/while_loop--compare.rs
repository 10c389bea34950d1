// %%optimize --compare: the original cell, instrumented by tchmem to stop after the compared steps
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
'tchmem_train: while step < 300 {
    tchmem::compare::step_begins();
    let xs = data.narrow(0, (step % 16) * 64, 64);
    let code = xs.apply(&encoder);
    let loss = decoder.forward(&code).mse_loss(&xs, tch::Reduction::Mean);
    opt.zero_grad();
    loss.backward();
    opt.step();
    step += 1;
    if tchmem::compare::record_step(&loss) {
        break 'tchmem_train;
    }
}
let reconstruction = decoder.forward(&data.apply(&encoder));
let final_loss = reconstruction.mse_loss(&data, tch::Reduction::Mean);
println!("final loss {:.5}", final_loss.double_value(&[]));
