// change: lines 21–22: --accumulate 4: the batch (xs, ys) runs as 4 micro-batches (tchmem::accumulate::split, along dim 0); each micro-batch's loss is weighted by its share of the batch, so the gradients add up to the whole batch's, and the optimizer steps once per batch; `loss` is the whole batch's loss, as before
// change: line 23: phases marked (tchmem::phase: forward, backward, optimizer step), so that the cell's record tells activations and optimizer state apart and %%memprofile shows the phases
// %%optimize --accumulate 4: rewritten by tchmem
// Comments inside the rewritten statements (at line 18 of the cell) were dropped: the printer cannot keep them.
use tch::nn::{Module, OptimizerConfig};
use tch::{nn, Device, Kind, Tensor};

let device = Device::cuda_if_available();
let vs = nn::VarStore::new(device);
let root = vs.root();
// A three-layer perceptron on random data.
let model = nn::seq()
    .add(nn::linear(&root / "l1", 784, 1024, Default::default()))
    .add_fn(|xs| xs.relu())
    .add(nn::linear(&root / "l2", 1024, 1024, Default::default()))
    .add_fn(|xs| xs.relu())
    .add(nn::linear(&root / "l3", 1024, 10, Default::default()));
let mut opt = nn::Adam::default().build(&vs, 1e-3)?;

let images = Tensor::randn([8192, 784], (Kind::Float, device));
let labels = Tensor::randint(10, [8192], (Kind::Int64, device));
for epoch in 1..=5 {
    let mut total = 0.0;
    for (xs, ys) in images.split(256, 0).iter().zip(labels.split(256, 0).iter()) {
        opt.zero_grad();
        let loss = {
            let mut accumulated: Option<tch::Tensor> = None;
            for (weight, [ref xs, ref ys]) in tchmem::accumulate::split(
                4,
                [&xs, &ys],
            ) {
                tchmem::phase::forward();
                let logits = model.forward(xs);
                let loss = logits.cross_entropy_for_logits(ys);
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
        total += loss.double_value(&[]);
    }
    println!("epoch {epoch}: mean loss {:.4}", total / 32.0);
}
