// %%optimize --compare: the original cell, instrumented by tchmem to stop after the compared steps
use tch::nn::{Module, OptimizerConfig};
use tch::{nn, Device, Kind, Tensor};

const VOCAB: i64 = 512;
const WIDTH: i64 = 64;
let device = Device::cuda_if_available();
let vs = nn::VarStore::new(device);
let root = vs.root();
// A small language model whose output head is a layer of its own.
let embed = nn::embedding(&root / "embed", VOCAB, WIDTH, Default::default());
let body = nn::seq()
    .add(nn::linear(&root / "l1", WIDTH, 4 * WIDTH, Default::default()))
    .add_fn(|xs| xs.gelu("none"))
    .add(nn::linear(&root / "l2", 4 * WIDTH, WIDTH, Default::default()))
    .add_fn(|xs| xs.gelu("none"))
    .add(nn::linear(&root / "l3", WIDTH, WIDTH, Default::default()));
let head = nn::linear(&root / "head", WIDTH, VOCAB, Default::default());
let mut opt = nn::AdamW::default().build(&vs, 1e-3)?;

let tokens = Tensor::randint(VOCAB, [64, 33], (Kind::Int64, device));
'tchmem_train: for epoch in 1..=3 {
    let mut total = 0.0;
    for batch in tokens.split(16, 0).iter() {
        tchmem::compare::step_begins();
        let xs = batch.narrow(1, 0, 32);
        let ys = batch.narrow(1, 1, 32);
        let hidden = body.forward(&xs.apply(&embed));
        let logits = hidden.apply(&head);
        let loss = logits
            .view([-1, VOCAB])
            .cross_entropy_for_logits(&ys.reshape([-1]));
        opt.backward_step(&loss);
        total += loss.double_value(&[]);
        if tchmem::compare::record_step(&loss) {
            break 'tchmem_train;
        }
    }
    println!("epoch {epoch}: mean loss {:.4}", total / 4.0);
}
