// %%optimize --compare: the original cell, instrumented by tchmem to stop after the compared steps
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
'tchmem_train: for epoch in 1..=5 {
    let mut total = 0.0;
    for (xs, ys) in images.split(256, 0).iter().zip(labels.split(256, 0).iter()) {
        tchmem::compare::step_begins();
        let logits = model.forward(xs);
        let loss = logits.cross_entropy_for_logits(ys);
        opt.backward_step(&loss);
        total += loss.double_value(&[]);
        if tchmem::compare::record_step(&loss) {
            break 'tchmem_train;
        }
    }
    println!("epoch {epoch}: mean loss {:.4}", total / 32.0);
}
