//! GPU check of the per-cell record: a ~200M-parameter fp32 MLP trained with Adam, recorded the
//! way the kernel records cells ("build", then two training-step cells using
//! `tchmem::phase::train_step`). Prints one JSON object with the parameter count and the records.
//!
//!     cargo run --release -p tchmem-runtime --example gpu_categories > record.json
//!
//! Expect parameters ≈ gradients ≈ 4 bytes × P, optimizer state ≈ 8 bytes × P (Adam's two
//! moments, created by the first step) and activations at backward of a few MB.

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tchmem::{hooks, record};

fn main() {
    let device = Device::cuda_if_available();
    let (width, layers) = (5000, 8);
    // As the kernel does when a session starts: the context alone, for the NVML reconciliation.
    let at_start = record::measure_context();
    hooks::before_cell();
    let vs = nn::VarStore::new(device);
    let mut model = nn::seq();
    for i in 0..layers {
        model = model
            .add(nn::linear(vs.root() / i, width, width, Default::default()))
            .add_fn(|x| x.relu());
    }
    tchmem::watch(&vs);
    let built = hooks::after_cell().record;
    let parameters: i64 = vs
        .trainable_variables()
        .iter()
        .map(|t| t.numel() as i64)
        .sum();

    let mut opt = nn::Adam::default().build(&vs, 1e-4).unwrap();
    let x = Tensor::randn([64, width], (Kind::Float, device));
    tchmem::watch_batch(&x);
    let mut steps = Vec::new();
    for _ in 0..2 {
        hooks::before_cell();
        let loss =
            tchmem::phase::train_step(&mut opt, || model.forward(&x).square().mean(Kind::Float));
        eprintln!("loss {}", loss.double_value(&[]));
        steps.push(hooks::after_cell().record);
    }

    let json = serde_json::json!({
        "device": format!("{device:?}"),
        "parameters": parameters,
        "context_at_start": at_start.map(|s| s.context),
        "workspace_at_start": at_start.map(|s| s.workspace),
        "after_build": built,
        "after_first_adam_step": steps[0],
        "after_second_adam_step": steps[1],
    });
    println!("{}", serde_json::to_string_pretty(&json).unwrap());
}
