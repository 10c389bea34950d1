//! `tchmem-runtime`: what notebook cells of the tchmem kernel use, imported as `tchmem`.
//!
//! Every cell of a tchmem kernel already depends on this crate and on `tch`; nothing needs a
//! `:dep` line. This is the only part of tchmem that links libtorch.

pub mod accumulate;
mod alloc_trace;
pub mod amp;
pub mod boxed;
mod busy_time;
mod categories;
pub mod checkpoint;
pub mod compare;
pub mod cuda_stats;
pub mod cudnn;
pub mod display;
pub mod dist;
pub mod error;
pub mod estimate;
mod ffi;
pub mod fused_loss;
pub mod hooks;
pub mod interrupt;
pub mod keep;
mod nvml;
pub mod oom;
pub mod op_trace;
pub mod record;
mod state;
pub mod timeline;
mod watch;

/// Asking the notebook's user for a line of text (Jupyter `input_request`).
pub mod input {
    pub use evcxr_input::{get_password, get_string};
}
pub mod optim;
mod panic_hook;
pub mod phase;
pub mod progress;
pub mod rebuild;

pub use error::RuntimeError;
pub use tch;
pub use tchmem_wire::memory::{Category, CategoryName, Counters, CudaMemory, MemoryRecord};
pub use watch::{tensor_bytes, watch, watch_batch};

pub use interrupt::interrupted;

/// Reports the step a loop is at, of `total` (`0`: unknown), for the live view under the running
/// cell: a bar and a time left. The kernel counts a cell's loops by itself; this says more.
///
/// ```no_run
/// for step in 0..1000 {
///     tchmem::progress(step + 1, 1000);
/// }
/// ```
pub fn progress<S: TryInto<u64>, T: TryInto<u64>>(step: S, total: T) {
    progress::report(step, total);
}

/// The version of this crate, as built into the current cell.
pub fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// Called by the kernel when a session starts; not meant for cells.
#[doc(hidden)]
pub fn __kernel_session_start() {
    panic_hook::install();
    hooks::register();
    // Before any cell allocates: the baseline NVML usage is compared with.
    record::measure_context();
    // Without CUDA (or CUDA headers at build time) the OOM counter and message remain.
    let _ = oom::attach_observer();
}
