//! `tchmem-runtime`: what notebook cells of the tchmem kernel use, imported as `tchmem`.
//!
//! Every cell of a tchmem kernel already depends on this crate and on `tch`; nothing needs a
//! `:dep` line. This is the only part of tchmem that links libtorch.

pub mod accumulate;
pub mod amp;
pub mod boxed;
mod categories;
pub mod checkpoint;
pub mod compare;
pub mod cuda_stats;
pub mod display;
pub mod error;
pub mod estimate;
mod ffi;
pub mod hooks;
pub mod keep;
mod nvml;
pub mod oom;
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

pub use error::RuntimeError;
pub use tch;
pub use tchmem_wire::memory::{Category, CategoryName, Counters, CudaMemory, MemoryRecord};
pub use watch::{tensor_bytes, watch, watch_batch};

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
