// change: line 14: --step-in-backward: nn::Adam → tchmem::optim::Adam::from(…) (the same settings), stepped in backward (`.in_backward()`): each parameter is updated as soon as its gradient is complete and the gradient freed, so the model's gradients never all live at once; `step()`/`zero_grad()` find nothing left
// change: line 23: phases marked (tchmem::phase: forward, backward, optimizer step), so that the cell's record tells activations and optimizer state apart and %%memprofile shows the phases
// %%optimize --step-in-backward: rewritten by tchmem
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
let mut opt = tchmem::optim::Adam::from(nn::Adam::default())
    .build(&vs, 1e-3)
    .map(tchmem::optim::Optimizer::in_backward)?;

let images = Tensor::randn([8192, 784], (Kind::Float, device));
let labels = Tensor::randint(10, [8192], (Kind::Int64, device));
for epoch in 1..=5 {
    let mut total = 0.0;
    for (xs, ys) in images.split(256, 0).iter().zip(labels.split(256, 0).iter()) {
        tchmem::phase::forward();
        let logits = model.forward(xs);
        let loss = logits.cross_entropy_for_logits(ys);
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
