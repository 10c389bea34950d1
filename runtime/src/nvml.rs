//! This process's GPU memory as the driver sees it (NVML), which includes the CUDA context and
//! libraries' workspaces that the allocator never sees.
//!
//! Three calls of the driver's library through its generated bindings (nvml-wrapper-sys), not the
//! safe wrapper: every notebook cell is a crate that cargo checks against the runtime's whole
//! dependency graph, and the wrapper with its derive macros was ten packages of it, for three
//! calls (results/vs-evcxr-cpu.txt).

use std::ffi::CStr;
use std::sync::OnceLock;

use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlProcessInfo_t,
    nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE as INSUFFICIENT_SIZE,
    nvmlReturn_enum_NVML_SUCCESS as SUCCESS, nvmlReturn_t, NvmlLib, NVML_VALUE_NOT_AVAILABLE,
};

use crate::error::{Result, RuntimeError};

/// The driver's library as the CUDA driver installs it.
const LIBRARY: &str = "libnvidia-ml.so.1";

/// NVML's "not available" (-1) in a process's unsigned memory field.
const NOT_AVAILABLE: u64 = NVML_VALUE_NOT_AVAILABLE as u64;

/// Room for processes that start between asking for the count and reading the list.
const HEADROOM: u32 = 5;

/// NVML, loaded and initialised once per process and never shut down: records need it until the
/// process ends.
fn driver() -> Result<&'static NvmlLib> {
    static DRIVER: OnceLock<Result<NvmlLib>> = OnceLock::new();
    DRIVER.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn load() -> Result<NvmlLib> {
    // SAFETY: loading the driver's own library, whose initialiser has no preconditions.
    let lib = unsafe { NvmlLib::new(LIBRARY) }
        .map_err(|e| nvml_error(format!("NVML unavailable: {e}")))?;
    let init = symbol(&lib.nvmlInit_v2, "NVML unavailable")?;
    // SAFETY: nvmlInit_v2 takes no arguments.
    check(&lib, unsafe { init() }, "NVML unavailable")?;
    Ok(lib)
}

fn nvml_error(text: String) -> RuntimeError {
    RuntimeError::Nvml(text)
}

/// A function of the driver's library, or why it is missing after `what` (an older driver).
fn symbol<'a, F, E: std::fmt::Display>(
    found: &'a std::result::Result<F, E>,
    what: &str,
) -> Result<&'a F> {
    found
        .as_ref()
        .map_err(|e| nvml_error(format!("{what}: {e}")))
}

/// `Ok` for NVML_SUCCESS, else the driver's own words for `code` after `what`.
fn check(lib: &NvmlLib, code: nvmlReturn_t, what: &str) -> Result<()> {
    if code == SUCCESS {
        return Ok(());
    }
    let words = lib
        .nvmlErrorString
        .as_ref()
        .ok()
        // SAFETY: nvmlErrorString returns a static, NUL-terminated string for any code.
        .map(|describe| {
            unsafe { CStr::from_ptr(describe(code)) }
                .to_string_lossy()
                .into_owned()
        })
        .unwrap_or_else(|| format!("error {code}"));
    Err(nvml_error(format!("{what}: {words}")))
}

fn device(lib: &NvmlLib, index: u32) -> Result<nvmlDevice_t> {
    let what = format!("NVML device {index}");
    let by_index = symbol(&lib.nvmlDeviceGetHandleByIndex_v2, &what)?;
    let mut handle: nvmlDevice_t = std::ptr::null_mut();
    // SAFETY: `handle` is a valid place for the handle NVML writes.
    check(lib, unsafe { by_index(index, &mut handle) }, &what)?;
    Ok(handle)
}

/// The processes with a compute context on `device`: NVML's count first, then the list.
fn compute_processes(lib: &NvmlLib, device: nvmlDevice_t) -> Result<Vec<nvmlProcessInfo_t>> {
    let what = "NVML process list";
    let list = symbol(&lib.nvmlDeviceGetComputeRunningProcesses_v3, what)?;
    let mut count = 0;
    // SAFETY: a null list with a count of 0 asks for the count (NVML_ERROR_INSUFFICIENT_SIZE).
    match unsafe { list(device, &mut count, std::ptr::null_mut()) } {
        INSUFFICIENT_SIZE => {}
        code => return check(lib, code, what).map(|()| Vec::new()),
    }
    count += HEADROOM;
    // SAFETY: plain C structs, for which all zeroes is a valid value.
    let mut processes = vec![unsafe { std::mem::zeroed::<nvmlProcessInfo_t>() }; count as usize];
    // SAFETY: `processes` holds `count` entries, as NVML is told.
    check(
        lib,
        unsafe { list(device, &mut count, processes.as_mut_ptr()) },
        what,
    )?;
    processes.truncate(count as usize);
    Ok(processes)
}

/// Device memory used by this process on CUDA device `index` (NVML's ordering is assumed to
/// match CUDA's, true unless CUDA_VISIBLE_DEVICES reorders them).
pub fn process_bytes(index: u32) -> Result<u64> {
    let lib = driver()?;
    let processes = compute_processes(lib, device(lib, index)?)?;
    let pid = std::process::id();
    match processes.iter().find(|p| p.pid == pid) {
        Some(process) if process.usedGpuMemory == NOT_AVAILABLE => Err(nvml_error(
            "NVML does not report per-process memory here".into(),
        )),
        Some(process) => Ok(process.usedGpuMemory),
        None => Err(nvml_error(
            "NVML does not list this process (no CUDA context yet?)".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_the_driver_the_error_says_nvml_is_unavailable() {
        if std::path::Path::new("/proc/driver/nvidia").exists() {
            return; // a machine with the driver: process_bytes is checked on the GPU.
        }
        let why = process_bytes(0).unwrap_err().to_string();
        assert!(why.contains("NVML unavailable"), "{why}");
    }
}
