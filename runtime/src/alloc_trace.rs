//! The CUDA caching allocator's own events over a calibration trial (csrc/alloc_trace.cpp): every
//! allocation and free from the trial's beginning to the end of its recorded step, with the
//! segments held when it began. The kernel replays the events it predicts at another batch
//! through its model of the allocator, for the reserved memory there (`fit::allocator`).
//!
//! One log serves the process (the allocator keeps every tracker attached to it): the first copy
//! of the runtime that needs it makes it, and its address stays in the process-wide state.
//! Without CUDA headers at build time there is no log, and trials carry no events.

use tchmem_wire::alloc_trace::{AllocTrace, Segment};

/// A trace with more events than this is dropped (its JSON would be tens of MiB): the estimate
/// then scales the cache instead.
#[cfg(tchmem_cuda_headers)]
const MAX_EVENTS: usize = 2_000_000;

#[cfg(tchmem_cuda_headers)]
mod shim {
    use std::ffi::{c_char, c_int, c_void};

    /// Receives one segment: pool, block sizes, in-use flags, count.
    pub type SegmentSink = extern "C" fn(*mut c_void, c_int, *const u64, *const u8, usize);
    /// Receives the events and the marks (operator, position pairs).
    pub type EventSink = extern "C" fn(*mut c_void, *const i64, usize, *const i64, usize);

    extern "C" {
        pub fn tchmem_alloc_log_new(
            device: c_int,
            log: *mut *mut c_void,
            err: *mut c_char,
            len: usize,
        ) -> c_int;
        pub fn tchmem_alloc_log_start(
            log: *mut c_void,
            device: c_int,
            context: *mut c_void,
            segment: SegmentSink,
            err: *mut c_char,
            len: usize,
        ) -> c_int;
        pub fn tchmem_alloc_log_stop(log: *mut c_void, context: *mut c_void, sink: EventSink);
    }
}

/// The process's log, made on first use (CUDA only); null when there is none. Only a run that
/// logs makes it: attached, the allocator's tracker is called on every request for the rest of
/// the process.
#[cfg(tchmem_cuda_headers)]
fn made_log() -> *mut std::ffi::c_void {
    if !tch::Cuda::is_available() {
        return std::ptr::null_mut();
    }
    let mut kept = crate::state::lock(&crate::state::shared().alloc_log);
    if *kept == 0 {
        let mut made = std::ptr::null_mut();
        let device = crate::cuda_stats::DEVICE as std::ffi::c_int;
        // SAFETY: a device index, an out-pointer to a local and the error buffer.
        if crate::ffi::call(|e, n| unsafe { shim::tchmem_alloc_log_new(device, &mut made, e, n) })
            .is_ok()
        {
            *kept = made as usize;
        }
    }
    *kept as *mut std::ffi::c_void
}

/// The process's log if a run made it, else null: for marking operators in it and logging a
/// replay's requests, which matter only beside trials that logged theirs.
pub(crate) fn existing_log() -> *mut std::ffi::c_void {
    *crate::state::lock(&crate::state::shared().alloc_log) as *mut std::ffi::c_void
}

/// Starts logging from now; the segments the allocator holds now, for [`stop`]. `None` when
/// there is no log (no CUDA) or the allocator's segments are not the kind modelled.
pub(crate) fn start() -> Option<Vec<Segment>> {
    #[cfg(tchmem_cuda_headers)]
    {
        extern "C" fn segment(
            context: *mut std::ffi::c_void,
            large: std::ffi::c_int,
            sizes: *const u64,
            in_use: *const u8,
            count: usize,
        ) {
            // SAFETY: `context` is the Vec below; the arrays hold `count` items each.
            unsafe {
                let out = &mut *(context as *mut Vec<Segment>);
                let sizes = crate::ffi::slice(sizes, count);
                let in_use = crate::ffi::slice(in_use, count);
                out.push(Segment {
                    large: large != 0,
                    blocks: sizes
                        .iter()
                        .zip(in_use)
                        .map(|(&b, &u)| (b, u != 0))
                        .collect(),
                });
            }
        }
        let log = made_log();
        if log.is_null() {
            return None;
        }
        let mut segments: Vec<Segment> = Vec::new();
        let context = &mut segments as *mut Vec<Segment> as *mut std::ffi::c_void;
        let device = crate::cuda_stats::DEVICE as std::ffi::c_int;
        // SAFETY: the process's log, the Vec above for the callback, the error buffer.
        let started = crate::ffi::call(|e, n| unsafe {
            shim::tchmem_alloc_log_start(log, device, context, segment, e, n)
        });
        started.ok().map(|()| segments)
    }
    #[cfg(not(tchmem_cuda_headers))]
    None
}

/// Stops logging; the events since [`start`], which gave `segments`.
pub(crate) fn stop(segments: Vec<Segment>) -> AllocTrace {
    #[cfg(tchmem_cuda_headers)]
    {
        extern "C" fn sink(
            context: *mut std::ffi::c_void,
            events: *const i64,
            count: usize,
            marks: *const i64,
            mark_count: usize,
        ) {
            // SAFETY: `context` is the trace below; `events` holds `count` items and `marks`
            // `2 * mark_count`.
            unsafe {
                let trace = &mut *(context as *mut AllocTrace);
                if count > MAX_EVENTS {
                    return;
                }
                trace.events = crate::ffi::slice(events, count).to_vec();
                trace.marks = crate::ffi::slice(marks, 2 * mark_count)
                    .chunks_exact(2)
                    .map(|pair| (pair[0], pair[1] as usize))
                    .collect();
            }
        }
        let mut trace = AllocTrace {
            segments,
            ..AllocTrace::default()
        };
        let log = existing_log();
        if !log.is_null() {
            // SAFETY: the process's log and the trace above for the callback.
            unsafe {
                shim::tchmem_alloc_log_stop(log, &mut trace as *mut AllocTrace as *mut _, sink)
            };
        }
        trace
    }
    #[cfg(not(tchmem_cuda_headers))]
    AllocTrace {
        segments,
        ..AllocTrace::default()
    }
}
