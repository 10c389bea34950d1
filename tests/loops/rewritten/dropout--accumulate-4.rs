// change: lines 28–29: --accumulate 4: the batch (bx, by) runs as 4 micro-batches (tchmem::accumulate::split, along dim 0); each micro-batch's loss is weighted by its share of the batch, so the gradients add up to the whole batch's, and the optimizer steps once per batch; `loss` is the whole batch's loss, as before
// change: line 31: phases marked (tchmem::phase: forward, backward, optimizer step), so that the cell's record tells activations and optimizer state apart and %%memprofile shows the phases
// %%optimize --accumulate 4: rewritten by tchmem
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
for epoch in 0..10 {
    let mut batches = tch::data::Iter2::new(&xs, &ys, 128);
    for (bx, by) in batches.shuffle() {
        opt.zero_grad();
        let loss = {
            let mut accumulated: Option<tch::Tensor> = None;
            for (weight, [ref bx, ref by]) in tchmem::accumulate::split(
                4,
                [&bx, &by],
            ) {
                tchmem::phase::forward();
                let pred = net.forward_t(&bx, true);
                let loss = pred.mse_loss(&by, tch::Reduction::Mean);
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
    }
    let test = net.forward_t(&xs, false).mse_loss(&ys, tch::Reduction::Mean);
    println!("epoch {epoch}: test mse {:.5}", test.double_value(& []));
}
