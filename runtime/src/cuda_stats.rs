//! The CUDA caching allocator's counters, through the C++ shim (csrc/memory.cpp).

use std::ffi::{c_char, c_int};

use crate::ffi::call;

use tchmem_wire::memory::Counters;

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct Stat {
    current: i64,
    peak: i64,
    allocated: i64,
    freed: i64,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct RawDeviceStats {
    allocated_bytes: Stat,
    reserved_bytes: Stat,
    active_bytes: Stat,
    requested_bytes: Stat,
    inactive_split_bytes: Stat,
    allocation: Stat,
    segment: Stat,
    num_alloc_retries: i64,
    num_ooms: i64,
    num_device_alloc: i64,
    num_device_free: i64,
}

extern "C" {
    fn tchmem_cuda_device_stats(
        device: c_int,
        out: *mut RawDeviceStats,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tchmem_cuda_reset_peak_stats(device: c_int, err: *mut c_char, err_len: usize) -> c_int;
    fn tchmem_cuda_memory_info(
        device: c_int,
        free: *mut u64,
        total: *mut u64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tchmem_cuda_empty_cache(err: *mut c_char, err_len: usize) -> c_int;
}

/// The allocator's statistics for one device.
#[derive(Debug, Clone, Copy, Default)]
pub struct DeviceStats {
    /// Current values.
    pub current: Counters,
    /// Peaks since the last reset.
    pub peak: Counters,
    /// Allocations made since the process started.
    pub allocations: i64,
    /// Cache-flush-and-retry events.
    pub alloc_retries: i64,
    /// Out-of-memory errors.
    pub ooms: i64,
}

fn unavailable() -> Result<(), String> {
    if tch::Cuda::is_available() {
        Ok(())
    } else {
        Err("CUDA is not available to libtorch in this process".into())
    }
}

fn bytes(value: i64) -> u64 {
    value.max(0) as u64
}

/// Reads the statistics of `device`.
pub fn device_stats(device: i64) -> Result<DeviceStats, String> {
    unavailable()?;
    let mut raw = RawDeviceStats::default();
    // SAFETY: `raw` matches the C struct layout; the error buffer is owned by `call`.
    call(|err, len| unsafe { tchmem_cuda_device_stats(device as c_int, &mut raw, err, len) })?;
    let counters = |pick: fn(&Stat) -> i64| Counters {
        allocated: bytes(pick(&raw.allocated_bytes)),
        reserved: bytes(pick(&raw.reserved_bytes)),
        active: bytes(pick(&raw.active_bytes)),
        requested: bytes(pick(&raw.requested_bytes)),
    };
    Ok(DeviceStats {
        current: counters(|s| s.current),
        peak: counters(|s| s.peak),
        allocations: raw.allocation.allocated,
        alloc_retries: raw.num_alloc_retries,
        ooms: raw.num_ooms,
    })
}

/// Starts a new peak measurement on `device`.
pub fn reset_peak_stats(device: i64) -> Result<(), String> {
    unavailable()?;
    // SAFETY: plain call into the shim.
    call(|err, len| unsafe { tchmem_cuda_reset_peak_stats(device as c_int, err, len) })
}

/// `(free, total)` device memory (cudaMemGetInfo).
pub fn memory_info(device: i64) -> Result<(u64, u64), String> {
    unavailable()?;
    let (mut free, mut total) = (0u64, 0u64);
    // SAFETY: the out-pointers are valid for the call.
    call(|err, len| unsafe {
        tchmem_cuda_memory_info(device as c_int, &mut free, &mut total, err, len)
    })?;
    Ok((free, total))
}

/// Returns the allocator's cached, unused blocks to the driver.
pub fn empty_cache() -> Result<(), String> {
    unavailable()?;
    // SAFETY: plain call into the shim.
    call(|err, len| unsafe { tchmem_cuda_empty_cache(err, len) })
}
