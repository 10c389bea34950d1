//! cuDNN's settings as a run reports them.

extern "C" {
    fn tchmem_cudnn_benchmark() -> std::ffi::c_int;
}

/// Whether cuDNN's benchmark mode is on (`tch::Cuda::cudnn_set_benchmark(true)`; tch's default
/// is off): the first step at each shape new to the process then times cuDNN's algorithms, with
/// a workspace for the largest that fits in what the allocator can get.
pub fn benchmark() -> bool {
    // SAFETY: reads a flag of libtorch's global context; no arguments, nothing to free.
    unsafe { tchmem_cudnn_benchmark() != 0 }
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_the_benchmark_mode_tch_sets() {
        tch::Cuda::cudnn_set_benchmark(true);
        assert!(super::benchmark());
        tch::Cuda::cudnn_set_benchmark(false);
        assert!(!super::benchmark());
    }
}
