//! The runtime's errors: why a measurement or a shim call could not be made.

/// Why the runtime could not do what was asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuntimeError {
    /// CUDA is not available to libtorch in this process (a CPU machine, or no driver).
    #[error("CUDA is not available to libtorch in this process")]
    NoCuda,
    /// The runtime was built without CUDA headers, so the allocator's C++ API is out of reach.
    #[error(
        "the runtime was built without CUDA headers (scripts/setup installs them: pip install \
         --no-deps nvidia-cuda-crt==13.0.88, then rebuild), so it cannot reach {0}"
    )]
    NoCudaHeaders(&'static str),
    /// libtorch (through the C++ shim in csrc/) raised an error; its message.
    #[error("{0}")]
    Torch(String),
    /// NVML could not answer; what it said.
    #[error("{0}")]
    Nvml(String),
    /// An allocation timeline could not be recorded or written; why.
    #[error("{0}")]
    Timeline(String),
    /// The operator recordings a replay asked for are not kept (never made, or dropped for
    /// newer ones); their identifiers.
    #[error("no operator recordings {0}, {1} (only the newest are kept)")]
    NoOpRecording(u64, u64),
    /// A collective of the process group failed on this rank (another rank stopped, or did not
    /// reach it within the group's timeout); which and what libtorch said.
    #[error(
        "rank {rank}: {what} failed: {why}. Another rank may have stopped or not reached it \
         (each collective waits up to the group's timeout, TCHMEM_DIST_TIMEOUT_S); the group \
         is out of step now: tchmem::dist::shutdown(), then init a new one"
    )]
    Dist {
        /// The rank this process is.
        rank: usize,
        /// The collective (`an all-reduce`).
        what: String,
        /// libtorch's message.
        why: String,
    },
    /// An argument outside what the call accepts; which and why.
    #[error("{0}")]
    Invalid(String),
}

/// A result whose error is a [`RuntimeError`].
pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
