// %%optimize --compare: the original cell, instrumented by tchmem to stop after the compared steps
use tch::nn::{Module, OptimizerConfig};
use tch::{nn, Device, Kind, Tensor};

let device = Device::cuda_if_available();
let vs = nn::VarStore::new(device);
let root = vs.root();
let mut model = nn::seq();
for i in 0..6 {
    model = model
        .add(nn::linear(&root / format!("layer{i}"), 256, 256, Default::default()))
        .add_fn(|xs| xs.relu());
}
let head = nn::linear(&root / "head", 256, 4, Default::default());
let mut opt = nn::Sgd {
    momentum: 0.9,
    ..Default::default()
}
.build(&vs, 0.01)?;

// Batches kept on the CPU, moved to the device one at a time.
let batches: Vec<(Tensor, Tensor)> = (0..16)
    .map(|_| {
        let xs = Tensor::randn([512, 256], (Kind::Float, Device::Cpu));
        let ys = Tensor::randint(4, [512], (Kind::Int64, Device::Cpu));
        (xs, ys)
    })
    .collect();
'tchmem_train: for epoch in 0..3 {
    for (i, (xs, ys)) in batches.iter().enumerate() {
        tchmem::compare::step_begins();
        let xs = xs.to_device(device);
        let ys = ys.to_device(device);
        let features = model.forward(&xs);
        let logits = head.forward(&features);
        let loss = logits.cross_entropy_for_logits(&ys);
        opt.backward_step_clip_norm(&loss, 1.0);
        if i % 8 == 0 {
            println!("epoch {epoch} batch {i}: loss {:.4}", loss.double_value(& []));
        }
        if tchmem::compare::record_step(&loss) {
            break 'tchmem_train;
        }
    }
}
