// change: line 22: --fused-loss: the head inside `model` and the cross-entropy → tchmem::fused_loss (chunks sized by the vocabulary): the loss and its gradients computed chunk by chunk in the forward pass, no logits tensor in forward or backward
// change: line 23: phases marked (tchmem::phase: forward, backward, optimizer step), so that the cell's record tells activations and optimizer state apart and %%memprofile shows the phases
// change: --fused-loss: `nn::linear(&root / "l3", 1024, 10, Default::default())`, the last layer of `model`, marked with tchmem::fused_loss::SplitHead: it is the head as before everywhere, and inside `split_head` gives the fused loss its input and weights instead of the logits
// %%optimize --fused-loss: rewritten by tchmem
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
    .add(
        tchmem::fused_loss::SplitHead(
            nn::linear(&root / "l3", 1024, 10, Default::default()),
        ),
    );
let mut opt = nn::Adam::default().build(&vs, 1e-3)?;

let images = Tensor::randn([8192, 784], (Kind::Float, device));
let labels = Tensor::randint(10, [8192], (Kind::Int64, device));
for epoch in 1..=5 {
    let mut total = 0.0;
    for (xs, ys) in images.split(256, 0).iter().zip(labels.split(256, 0).iter()) {
        tchmem::phase::forward();
        let logits = tchmem::fused_loss::split_head(|| model.forward(xs));
        let loss = logits.cross_entropy(ys);
        tchmem::phase::backward();
        opt.zero_grad();
        loss.backward();
        tchmem::phase::step();
        opt.step();
        tchmem::phase::end();
        total += loss.double_value(&[]);
    }
    println!("epoch {epoch}: mean loss {:.4}", total / 32.0);
}
