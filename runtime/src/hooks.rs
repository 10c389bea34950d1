//! The kernel's child calls these around every cell, through the two `extern "C"` hooks it
//! finds by symbol (so no compile is needed per cell): before a cell, the allocator's peaks are
//! reset and its counters noted; after it, the cell's memory record is built and handed over as
//! JSON. Programs outside the kernel call [`before_cell`] and [`after_cell`] directly.

use std::ffi::{c_char, CString};

use tchmem_wire::progress::MemoryNow;
use tchmem_wire::AfterCell;

use crate::cuda_stats::{self, DEVICE};
use crate::record;
use crate::state::{self, Before};

/// Starts a cell: resets the allocator's peaks and remembers the counters.
pub fn before_cell() {
    let before = cuda_stats::device_stats(DEVICE)
        .ok()
        .map(|stats| Before::from(&stats));
    if before.is_some() {
        let _ = cuda_stats::reset_peak_stats(DEVICE);
    }
    crate::phase::before_cell();
    crate::oom::take_events();
    *state::lock(&state::shared().before) = before;
}

/// Ends a cell: the record of what it did, and the timeline recorded around it.
pub fn after_cell() -> AfterCell {
    // First, so that the counters below include what the cell's last kernels freed.
    let timeline = crate::timeline::finish();
    crate::op_trace::abandon();
    crate::busy_time::abandon();
    let before = state::lock(&state::shared().before).take();
    let record = match cuda_stats::device_stats(DEVICE) {
        Ok(stats) => record::cuda_record(stats, before),
        Err(why) => record::cpu_record(why),
    };
    AfterCell { record, timeline }
}

/// Gives the kernel's child this runtime's hooks (called when a session starts).
pub(crate) fn register() {
    use std::sync::atomic::Ordering;
    if let Some(slot) = state::child_slot() {
        let before: extern "C" fn() = tchmem_runtime_before_cell;
        let after: extern "C" fn() -> *mut c_char = tchmem_runtime_after_cell;
        let free: unsafe extern "C" fn(*mut c_char) = tchmem_runtime_free;
        slot.before_cell.store(before as *mut _, Ordering::Release);
        slot.after_cell.store(after as *mut _, Ordering::Release);
        slot.free.store(free as *mut _, Ordering::Release);
        let sample: unsafe extern "C" fn(*mut MemoryNow) -> bool = tchmem_runtime_sample_memory;
        slot.run
            .sample_memory
            .store(sample as *mut _, Ordering::Release);
    }
}

/// The device's memory now, for the live view (none without CUDA or before the device is used:
/// asking then would create a CUDA context).
pub fn memory_now() -> Option<MemoryNow> {
    static CAPACITY: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let stats = cuda_stats::device_stats(DEVICE).ok()?;
    if stats.current.reserved == 0 && CAPACITY.get().is_none() {
        return None;
    }
    let capacity = match CAPACITY.get() {
        Some(&capacity) => capacity,
        None => {
            let (_, total) = cuda_stats::memory_info(DEVICE).ok()?;
            *CAPACITY.get_or_init(|| total)
        }
    };
    Some(MemoryNow {
        allocated: stats.current.allocated,
        reserved: stats.current.reserved,
        peak_allocated: stats.peak.allocated,
        peak_reserved: stats.peak.reserved,
        capacity,
    })
}

/// Hook for the kernel's child: the device's memory now, written to `out`; false if unknown.
///
/// # Safety
/// `out` must be null or point to a writable `MemoryNow`.
pub unsafe extern "C" fn tchmem_runtime_sample_memory(out: *mut MemoryNow) -> bool {
    match std::panic::catch_unwind(memory_now) {
        Ok(Some(now)) if !out.is_null() => {
            // SAFETY: the child passes a valid, writable MemoryNow.
            unsafe { *out = now };
            true
        }
        _ => false,
    }
}

/// Hook for the kernel's child: before a cell.
pub extern "C" fn tchmem_runtime_before_cell() {
    let _ = std::panic::catch_unwind(before_cell);
}

/// Hook for the kernel's child: after a cell; returns the record as JSON, to be released with
/// [`tchmem_runtime_free`]. Null if measuring failed.
pub extern "C" fn tchmem_runtime_after_cell() -> *mut c_char {
    std::panic::catch_unwind(|| {
        let json = serde_json::to_string(&after_cell()).ok()?;
        CString::new(json).ok()
    })
    .ok()
    .flatten()
    .map_or(std::ptr::null_mut(), CString::into_raw)
}

/// Releases a string returned by [`tchmem_runtime_after_cell`].
///
/// # Safety
/// `text` must come from [`tchmem_runtime_after_cell`] and be released once.
pub unsafe extern "C" fn tchmem_runtime_free(text: *mut c_char) {
    if !text.is_null() {
        drop(CString::from_raw(text));
    }
}
