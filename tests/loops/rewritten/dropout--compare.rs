// %%optimize --compare: the original cell, instrumented by tchmem to stop after the compared steps
// Comments inside the rewritten statements (at line 23 of the cell) were dropped: the printer cannot keep them.
use tch::nn::{ModuleT, OptimizerConfig};
use tch::{nn, Device, Kind, Tensor};

let device = Device::cuda_if_available();
let vs = nn::VarStore::new(device);
let p = vs.root();
let net = nn::seq_t()
    .add(nn::linear(&p / "fc1", 512, 2048, Default::default()))
    .add_fn(|xs| xs.gelu("none"))
    .add_fn_t(|xs, train| xs.dropout(0.1, train))
    .add(nn::linear(&p / "fc2", 2048, 2048, Default::default()))
    .add_fn(|xs| xs.gelu("none"))
    .add_fn_t(|xs, train| xs.dropout(0.1, train))
    .add(nn::linear(&p / "fc3", 2048, 1, Default::default()));
let mut opt = nn::AdamW {
    wd: 0.05,
    ..Default::default()
}
.build(&vs, 3e-4)?;

let xs = Tensor::randn([4096, 512], (Kind::Float, device));
let ys = xs.sum_dim_intlist(1, true, Kind::Float).tanh();
'tchmem_train: for epoch in 0..10 {
    let mut batches = tch::data::Iter2::new(&xs, &ys, 128);
    for (bx, by) in batches.shuffle() {
        tchmem::compare::step_begins();
        opt.zero_grad();
        let pred = net.forward_t(&bx, true);
        let loss = pred.mse_loss(&by, tch::Reduction::Mean);
        loss.backward();
        opt.step();
        if tchmem::compare::record_step(&loss) {
            break 'tchmem_train;
        }
    }
    let test = net.forward_t(&xs, false).mse_loss(&ys, tch::Reduction::Mean);
    println!("epoch {epoch}: test mse {:.5}", test.double_value(& []));
}
