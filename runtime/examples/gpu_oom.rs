//! GPU check of the out-of-memory signals the kernel relies on: (1) one request larger than the
//! device, (2) memory filled with 4 GiB tensors until an allocation fails. For each, whether the
//! allocator's OOM counter (`ooms` in the record) moved, what libtorch's OOM observer reported
//! (`oom_events`) and libtorch's message. Prints JSON.
//!
//!     cargo run --release -p tchmem-runtime --example gpu_oom > oom.json

use tch::{Device, Kind, Tensor};
use tchmem::hooks;

fn first_line(error: tch::TchError) -> String {
    error
        .to_string()
        .lines()
        .next()
        .unwrap_or_default()
        .to_string()
}

fn main() {
    let device = Device::cuda_if_available();
    // As the kernel does when a session starts.
    let observer = tchmem::oom::attach_observer();

    hooks::before_cell();
    // 1 Ti float32 elements = 4 TiB: more than any GPU has.
    let result = Tensor::f_zeros([1 << 40], (Kind::Float, device));
    let oversized = serde_json::json!({
        "allocation_failed": result.is_err(),
        "error": result.err().map(first_line),
        "record": hooks::after_cell().record,
    });

    hooks::before_cell();
    let mut held = Vec::new();
    let error = loop {
        match Tensor::f_zeros([1 << 30], (Kind::Float, device)) {
            Ok(t) => held.push(t),
            Err(e) => break first_line(e),
        }
        if held.len() > 1024 {
            break "no failure after 4 TiB".into();
        }
    };
    let filled = serde_json::json!({
        "tensors_of_4_GiB_held": held.len(),
        "error": error,
        "record": hooks::after_cell().record,
    });
    drop(held);

    let json = serde_json::json!({
        "device": format!("{device:?}"),
        "observer_attached": observer.map_err(|e| e.to_string()),
        "oversized_request": oversized,
        "memory_filled": filled,
    });
    println!("{}", serde_json::to_string_pretty(&json).unwrap());
}
