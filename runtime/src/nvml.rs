//! This process's GPU memory as the driver sees it (NVML), which includes the CUDA context and
//! libraries' workspaces that the allocator never sees.

use std::sync::OnceLock;

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::Nvml;

fn nvml() -> Result<&'static Nvml, String> {
    static NVML: OnceLock<Result<Nvml, String>> = OnceLock::new();
    NVML.get_or_init(|| Nvml::init().map_err(|e| format!("NVML unavailable: {e}")))
        .as_ref()
        .map_err(Clone::clone)
}

/// Device memory used by this process on CUDA device `index` (NVML's ordering is assumed to
/// match CUDA's, true unless CUDA_VISIBLE_DEVICES reorders them).
pub fn process_bytes(index: u32) -> Result<u64, String> {
    let device = nvml()?
        .device_by_index(index)
        .map_err(|e| format!("NVML device {index}: {e}"))?;
    let pid = std::process::id();
    let processes = device
        .running_compute_processes()
        .map_err(|e| format!("NVML process list: {e}"))?;
    match processes.iter().find(|p| p.pid == pid) {
        Some(process) => match process.used_gpu_memory {
            UsedGpuMemory::Used(bytes) => Ok(bytes),
            UsedGpuMemory::Unavailable => {
                Err("NVML does not report per-process memory here".into())
            }
        },
        None => Err("NVML does not list this process (no CUDA context yet?)".into()),
    }
}
