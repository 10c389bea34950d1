//! Benchmark: what recording costs per cell. Runs the before/after hooks the kernel's child calls
//! around every cell, on a watched model, and prints the time per cell next to the time of an
//! empty cell-sized step (a small forward pass) without recording.
//!
//!     cargo run --release -p tchmem-runtime --example record_overhead [-- CELLS]
//!
//! On a CUDA machine the model lives on the GPU and the hooks read the allocator and NVML.

use std::time::Instant;

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use tchmem::hooks;

fn main() {
    let cells: usize = std::env::args()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or(200);
    let device = Device::cuda_if_available();
    let vs = nn::VarStore::new(device);
    let model = nn::seq()
        .add(nn::linear(vs.root() / "a", 1024, 1024, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "b", 1024, 1024, Default::default()));
    tchmem::watch(&vs);
    let x = Tensor::randn([64, 1024], (Kind::Float, device));
    tchmem::watch_batch(&x);

    let step = || {
        let y = model.forward(&x).sum(Kind::Float);
        y.double_value(&[]) // waits for the device
    };
    for _ in 0..10 {
        step();
        hooks::before_cell();
        hooks::after_cell();
    }

    let started = Instant::now();
    for _ in 0..cells {
        step();
    }
    let plain = started.elapsed().as_secs_f64() / cells as f64;

    let started = Instant::now();
    let mut categories = 0;
    for _ in 0..cells {
        hooks::before_cell();
        step();
        categories += hooks::after_cell().record.categories.len();
    }
    let recorded = started.elapsed().as_secs_f64() / cells as f64;

    println!(
        "device: {device:?}, {cells} cells, {} categories per record",
        categories / cells
    );
    println!("{:<36} {:>10}", "per cell", "ms");
    println!("{:<36} {:>10.3}", "step without recording", plain * 1e3);
    println!(
        "{:<36} {:>10.3}",
        "step with before/after hooks",
        recorded * 1e3
    );
    println!(
        "{:<36} {:>10.3}",
        "recording overhead",
        (recorded - plain) * 1e3
    );
}
