//! GPU check of the per-cell record: a ~200M-parameter fp32 MLP trained one Adam step, recorded
//! the way the kernel records a cell. Prints one JSON object: the parameter count and the records
//! after building the model and after the first training step.
//!
//!     cargo run --release -p tchmem-runtime --example gpu_categories > record.json
//!
//! Expect parameters ≈ gradients ≈ 4 bytes × P, and Adam's two moments (8 bytes × P) inside
//! "other tensors" until optimizer state is told apart.

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tchmem::record;

fn main() {
    let device = Device::cuda_if_available();
    let (width, layers) = (5000, 8);
    record::before_cell();
    let vs = nn::VarStore::new(device);
    let mut model = nn::seq();
    for i in 0..layers {
        model = model
            .add(nn::linear(vs.root() / i, width, width, Default::default()))
            .add_fn(|x| x.relu());
    }
    tchmem::watch(&vs);
    let built = record::after_cell();
    let parameters: i64 = vs
        .trainable_variables()
        .iter()
        .map(|t| t.numel() as i64)
        .sum();

    let mut opt = nn::Adam::default().build(&vs, 1e-4).unwrap();
    let x = Tensor::randn([64, width], (Kind::Float, device));
    tchmem::watch_batch(&x);
    record::before_cell();
    let loss = model.forward(&x).square().mean(Kind::Float);
    opt.backward_step(&loss); // zeroes gradients before backward, so they remain after
    let stepped = record::after_cell();

    let json = serde_json::json!({
        "device": format!("{device:?}"),
        "parameters": parameters,
        "after_build": built,
        "after_first_adam_step": stepped,
    });
    println!("{}", serde_json::to_string_pretty(&json).unwrap());
}
