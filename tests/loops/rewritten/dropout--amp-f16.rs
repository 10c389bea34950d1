// change: line 19: --amp f16: nn::AdamW → tchmem::optim::AdamW::from(…): the same update and settings on torch's fused kernel (tch's launches several kernels per parameter, a visible share of a mixed-precision step)
// change: line 19: --amp f16: a tchmem::amp::GradScaler (`grad_scaler`) is created after the optimizer `opt`
// change: lines 28–29: --amp f16: the forward pass and loss run under tchmem::amp::autocast(Half): matmuls and convolutions compute in f16, so their activations take half the memory; parameters, gradients and optimizer state stay f32
// change: line 31: --amp f16: grad_scaler.backward_step(&mut opt, &loss) replaces the step: it scales the loss so that f16 gradients do not underflow, unscales them, and skips the step when they overflow
// change: line 31: phases marked (tchmem::phase: forward, backward, optimizer step), so that the cell's record tells activations and optimizer state apart and %%memprofile shows the phases
// %%optimize --amp f16: rewritten by tchmem
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
let mut opt = tchmem::optim::AdamW::from(nn::AdamW {
        wd: 0.05,
        ..Default::default()
    })
    .build(&vs, 3e-4)?;
let mut grad_scaler = tchmem::amp::GradScaler::new(&vs);

let xs = Tensor::randn([4096, 512], (Kind::Float, device));
let ys = xs.sum_dim_intlist(1, true, Kind::Float).tanh();
for epoch in 0..10 {
    let mut batches = tch::data::Iter2::new(&xs, &ys, 128);
    for (bx, by) in batches.shuffle() {
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
        tchmem::phase::backward();
        grad_scaler.backward_step(&mut opt, &loss);
        tchmem::phase::end();
    }
    let test = net.forward_t(&xs, false).mse_loss(&ys, tch::Reduction::Mean);
    println!("epoch {epoch}: test mse {:.5}", test.double_value(& []));
}
