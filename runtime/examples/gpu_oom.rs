//! GPU check of the out-of-memory signal the kernel relies on: an allocation larger than the
//! device must show up as `ooms` in the cell's record (the allocator's counter), whatever the
//! error text says. Prints the record as JSON.
//!
//!     cargo run --release -p tchmem-runtime --example gpu_oom > oom.json

use tch::{Device, Kind, Tensor};
use tchmem::record;

fn main() {
    let device = Device::cuda_if_available();
    record::before_cell();
    // 1 Ti float32 elements = 4 TiB: more than any GPU has.
    let result = Tensor::f_zeros([1 << 40], (Kind::Float, device));
    let record = record::after_cell();
    let json = serde_json::json!({
        "device": format!("{device:?}"),
        "allocation_failed": result.is_err(),
        "error": result.err().map(|e| e.to_string().lines().next().unwrap_or_default().to_string()),
        "record": record,
    });
    println!("{}", serde_json::to_string_pretty(&json).unwrap());
}
