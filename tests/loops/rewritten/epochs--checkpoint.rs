// change: line 7: --checkpoint: nn::seq() → tchmem::checkpoint::seq() (√layers segments): activations inside each segment are recomputed in the backward pass instead of being kept
// change: line 35: phases marked (tchmem::phase: forward, backward, optimizer step), so that the cell's record tells activations and optimizer state apart and %%memprofile shows the phases
// %%optimize --checkpoint: rewritten by tchmem
use tch::nn::{Module, OptimizerConfig};
use tch::{nn, Device, Kind, Tensor};

let device = Device::cuda_if_available();
let vs = nn::VarStore::new(device);
let root = vs.root();
let mut model = tchmem::checkpoint::seq();
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
for epoch in 0..3 {
    for (i, (xs, ys)) in batches.iter().enumerate() {
        let xs = xs.to_device(device);
        let ys = ys.to_device(device);
        tchmem::phase::forward();
        let features = model.forward(&xs);
        let logits = head.forward(&features);
        let loss = logits.cross_entropy_for_logits(&ys);
        tchmem::phase::backward();
        opt.zero_grad();
        loss.backward();
        opt.clip_grad_norm(1.0);
        tchmem::phase::step();
        opt.step();
        tchmem::phase::end();
        if i % 8 == 0 {
            println!("epoch {epoch} batch {i}: loss {:.4}", loss.double_value(& []));
        }
    }
}
