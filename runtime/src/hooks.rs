//! The kernel's child calls these around every cell, through the two `extern "C"` hooks it
//! finds by symbol (so no compile is needed per cell): before a cell, the allocator's peaks are
//! reset and its counters noted; after it, the cell's memory record is built and handed over as
//! JSON. Programs outside the kernel call [`before_cell`] and [`after_cell`] directly.

use std::ffi::{c_char, CString};

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
