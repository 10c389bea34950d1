//! `gpt_bench` as a shared library with one C entry point, for `scripts/gpu/snapshot_peak.py`:
//! loaded into a PyTorch process (the same libtorch), our training steps allocate through the
//! same CUDA caching allocator, so `torch.cuda.memory._record_memory_history` records them and
//! the two frameworks' allocations at their peaks can be compared block by block.

use std::ffi::{c_char, c_int, CStr};

#[allow(dead_code)]
#[path = "gpt_bench.rs"]
mod bench;

/// Runs one configuration (`config`, e.g. "bf16") for `steps` steps at the default model size
/// and prints its JSON line. Returns 0, or 1 if the configuration panicked.
///
/// # Safety
/// `config` must be a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tchmem_gpt_bench(config: *const c_char, steps: c_int) -> c_int {
    let config = unsafe { CStr::from_ptr(config) }
        .to_string_lossy()
        .into_owned();
    let device = tch::Device::cuda_if_available();
    match std::panic::catch_unwind(|| bench::run(&config, steps as usize, 16, 1024, 13, device)) {
        Ok(result) => {
            println!("{result}");
            0
        }
        Err(_) => 1,
    }
}
