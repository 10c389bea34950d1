//! This process's GPU memory as the driver sees it (NVML), which includes the CUDA context and
//! libraries' workspaces that the allocator never sees.

use std::sync::OnceLock;

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::Nvml;

use crate::error::{Result, RuntimeError};

fn nvml() -> Result<&'static Nvml> {
    static NVML: OnceLock<Result<Nvml>> = OnceLock::new();
    NVML.get_or_init(|| Nvml::init().map_err(|e| nvml_error(format!("NVML unavailable: {e}"))))
        .as_ref()
        .map_err(Clone::clone)
}

fn nvml_error(text: String) -> RuntimeError {
    RuntimeError::Nvml(text)
}

/// Device memory used by this process on CUDA device `index` (NVML's ordering is assumed to
/// match CUDA's, true unless CUDA_VISIBLE_DEVICES reorders them).
pub fn process_bytes(index: u32) -> Result<u64> {
    let device = nvml()?
        .device_by_index(index)
        .map_err(|e| nvml_error(format!("NVML device {index}: {e}")))?;
    let pid = std::process::id();
    let processes = device
        .running_compute_processes()
        .map_err(|e| nvml_error(format!("NVML process list: {e}")))?;
    match processes.iter().find(|p| p.pid == pid) {
        Some(process) => match process.used_gpu_memory {
            UsedGpuMemory::Used(bytes) => Ok(bytes),
            UsedGpuMemory::Unavailable => Err(nvml_error(
                "NVML does not report per-process memory here".into(),
            )),
        },
        None => Err(nvml_error(
            "NVML does not list this process (no CUDA context yet?)".into(),
        )),
    }
}
