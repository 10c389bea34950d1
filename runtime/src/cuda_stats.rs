//! The CUDA caching allocator's counters, through the C++ shim (csrc/memory.cpp), and its two
//! knobs a notebook needs to check whether a loop fits: the memory fraction it may reserve
//! (csrc/memory_fraction.cpp) and freeing its cache.

use std::ffi::{c_char, c_int};

use crate::error::{Result, RuntimeError};
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

#[cfg(tchmem_cuda_headers)]
extern "C" {
    fn tchmem_cuda_set_memory_fraction(
        device: c_int,
        fraction: f64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tchmem_cuda_memory_fraction(
        device: c_int,
        out: *mut f64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
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

fn unavailable() -> Result<()> {
    if tch::Cuda::is_available() {
        Ok(())
    } else {
        Err(RuntimeError::NoCuda)
    }
}

fn bytes(value: i64) -> u64 {
    value.max(0) as u64
}

/// Reads the statistics of `device`.
pub fn device_stats(device: i64) -> Result<DeviceStats> {
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
pub fn reset_peak_stats(device: i64) -> Result<()> {
    unavailable()?;
    // SAFETY: plain call into the shim.
    call(|err, len| unsafe { tchmem_cuda_reset_peak_stats(device as c_int, err, len) })
}

/// `(free, total)` device memory (cudaMemGetInfo).
pub fn memory_info(device: i64) -> Result<(u64, u64)> {
    unavailable()?;
    let (mut free, mut total) = (0u64, 0u64);
    // SAFETY: the out-pointers are valid for the call.
    call(|err, len| unsafe {
        tchmem_cuda_memory_info(device as c_int, &mut free, &mut total, err, len)
    })?;
    Ok((free, total))
}

/// Returns the allocator's cached, unused blocks to the driver.
pub fn empty_cache() -> Result<()> {
    unavailable()?;
    // SAFETY: plain call into the shim.
    call(|err, len| unsafe { tchmem_cuda_empty_cache(err, len) })
}

/// The CUDA device the runtime measures, and that [`set_memory_fraction`], [`memory_fraction`]
/// and [`free_cache`] act on (cuda:0).
pub(crate) const DEVICE: i64 = 0;

/// Makes sure the allocator has its per-device state for the device (created on first use),
/// which the memory fraction lives in.
#[cfg_attr(not(tchmem_cuda_headers), allow(dead_code))]
fn touch_device() {
    let device = tch::Device::Cuda(DEVICE as usize);
    drop(tch::Tensor::zeros([1], (tch::Kind::Float, device)));
}

/// Caps what the allocator may reserve on the device at `fraction` of its memory (as
/// `torch.cuda.set_per_process_memory_fraction`): beyond that, allocations fail as out of
/// memory, as on a smaller GPU. 1 lifts the cap.
pub fn set_memory_fraction(fraction: f64) -> Result<()> {
    if !(fraction > 0.0 && fraction <= 1.0) {
        return Err(RuntimeError::Invalid(format!(
            "the memory fraction must lie in (0, 1], not {fraction}"
        )));
    }
    unavailable()?;
    #[cfg(tchmem_cuda_headers)]
    {
        touch_device();
        // SAFETY: plain call into the shim.
        call(|err, len| unsafe {
            tchmem_cuda_set_memory_fraction(DEVICE as c_int, fraction, err, len)
        })
    }
    #[cfg(not(tchmem_cuda_headers))]
    {
        Err(no_cuda_headers())
    }
}

/// The share of the device's memory the allocator may reserve (1 when uncapped).
pub fn memory_fraction() -> Result<f64> {
    unavailable()?;
    #[cfg(tchmem_cuda_headers)]
    {
        touch_device();
        let mut fraction = 0.0;
        // SAFETY: the out-pointer is valid for the call.
        call(|err, len| unsafe {
            tchmem_cuda_memory_fraction(DEVICE as c_int, &mut fraction, err, len)
        })?;
        Ok(fraction)
    }
    #[cfg(not(tchmem_cuda_headers))]
    {
        Err(no_cuda_headers())
    }
}

#[cfg(not(tchmem_cuda_headers))]
fn no_cuda_headers() -> RuntimeError {
    RuntimeError::NoCudaHeaders("the allocator's memory fraction")
}

/// What [`free_cache`] gave back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Freed {
    /// Bytes the allocator held from the driver before.
    pub reserved_before: u64,
    /// Bytes it holds after: what live tensors' blocks still need.
    pub reserved_after: u64,
    /// Bytes in live tensors (unchanged by freeing the cache).
    pub allocated: u64,
}

impl Freed {
    /// Bytes returned to the driver.
    pub fn released(&self) -> u64 {
        self.reserved_before.saturating_sub(self.reserved_after)
    }
}

/// Returns the allocator's cached, unused blocks on the device to the driver, once its pending
/// work is done (so that blocks freed by running kernels count as unused), and says how much.
pub fn free_cache() -> Result<Freed> {
    unavailable()?;
    tch::Cuda::synchronize(DEVICE);
    let before = device_stats(DEVICE)?.current;
    empty_cache()?;
    let after = device_stats(DEVICE)?.current;
    Ok(Freed {
        reserved_before: before.reserved,
        reserved_after: after.reserved,
        allocated: after.allocated,
    })
}
