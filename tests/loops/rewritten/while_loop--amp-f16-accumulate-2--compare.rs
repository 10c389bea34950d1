// %%optimize --compare: the rewritten cell, instrumented by tchmem to stop after the compared steps
// %%optimize --amp f16 --accumulate 2: rewritten by tchmem
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
'tchmem_train: while step < 300 {
    tchmem::compare::step_begins();
    let xs = data.narrow(0, (step % 16) * 64, 64);
    opt.zero_grad();
    let loss = {
        let mut accumulated: Option<tch::Tensor> = None;
        for (weight, [ref xs]) in tchmem::accumulate::split(2, [&xs]) {
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
    if tchmem::compare::record_step(&loss) {
        break 'tchmem_train;
    }
}
let reconstruction = decoder.forward(&data.apply(&encoder));
let final_loss = reconstruction.mse_loss(&data, tch::Reduction::Mean);
println!("final loss {:.5}", final_loss.double_value(&[]));
