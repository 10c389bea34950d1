//! Allocation timelines (`%%memprofile`): libtorch's allocation history recorded around a cell
//! (csrc/history.cpp), the phase of each allocation stamped on it by the `tchmem::phase`
//! markers, and what the runtime knows about the blocks (watched tensors' storages), handed to
//! the kernel, which draws it.
//!
//! The kernel starts a timeline by putting `tchmem::timeline::begin_in_cell(…)` on the magic's
//! line of the cell; the child's after-cell hook ends it. A program can do the same with
//! [`begin`] and [`finish`].

use std::time::{SystemTime, UNIX_EPOCH};

use tch::Device;
use tchmem_wire::memory::{Category, CategoryName};
use tchmem_wire::timeline::{PhaseMark, TimelineCapture, TimelineRequest};

pub use tchmem_wire::timeline::{
    Phase, Storage, TimelineCapture as Capture, TimelineRequest as Request,
};

use crate::cuda_stats::{self, DEVICE};
use crate::error::RuntimeError;
use crate::state::{self, Recording as Active};
use crate::{categories, watch};

fn active() -> std::sync::MutexGuard<'static, Option<Active>> {
    state::lock(&state::shared().timeline)
}

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

#[cfg(tchmem_cuda_headers)]
mod shim {
    use std::ffi::{c_char, c_int, c_void};
    extern "C" {
        pub fn tchmem_history_start(
            max_entries: usize,
            stacks: c_int,
            err: *mut c_char,
            err_len: usize,
        ) -> c_int;
        pub fn tchmem_history_stop(err: *mut c_char, err_len: usize) -> c_int;
        pub fn tchmem_history_snapshot(
            sink: extern "C" fn(*mut c_void, *const c_char, usize),
            context: *mut c_void,
            err: *mut c_char,
            err_len: usize,
        ) -> c_int;
        pub fn tchmem_history_set_metadata(
            text: *const c_char,
            err: *mut c_char,
            err_len: usize,
        ) -> c_int;
    }
}

#[cfg(tchmem_cuda_headers)]
mod history {
    use super::shim::*;
    use crate::error::{Result, RuntimeError};
    use crate::ffi::call;
    use std::ffi::{c_char, c_void, CString};

    pub fn start(max_entries: u64, stacks: bool) -> Result<()> {
        // SAFETY: plain arguments and the error buffer `call` provides.
        call(|e, n| unsafe { tchmem_history_start(max_entries as usize, stacks as i32, e, n) })
    }

    pub fn stop() -> Result<()> {
        // SAFETY: as above.
        call(|e, n| unsafe { tchmem_history_stop(e, n) })
    }

    extern "C" fn append(context: *mut c_void, data: *const c_char, len: usize) {
        // SAFETY: `context` is the `Vec<u8>` passed below; `data` holds `len` bytes.
        unsafe {
            let out = &mut *(context as *mut Vec<u8>);
            out.extend_from_slice(crate::ffi::slice(data.cast::<u8>(), len));
        }
    }

    pub fn snapshot() -> Result<Vec<u8>> {
        let mut out: Vec<u8> = Vec::new();
        let context = &mut out as *mut Vec<u8> as *mut c_void;
        // SAFETY: the shim calls `append` with `context` before it returns.
        call(|e, n| unsafe { tchmem_history_snapshot(append, context, e, n) })?;
        Ok(out)
    }

    pub fn set_metadata(text: &str) -> Result<()> {
        let text = CString::new(text).map_err(|e| RuntimeError::Invalid(e.to_string()))?;
        // SAFETY: a NUL-terminated string that outlives the call.
        call(|e, n| unsafe { tchmem_history_set_metadata(text.as_ptr(), e, n) })
    }
}

#[cfg(not(tchmem_cuda_headers))]
mod history {
    use crate::error::{Result, RuntimeError};

    const WHY: RuntimeError = RuntimeError::NoCudaHeaders("libtorch's allocation history");
    pub fn start(_: u64, _: bool) -> Result<()> {
        Err(WHY)
    }
    pub fn stop() -> Result<()> {
        Err(WHY)
    }
    pub fn snapshot() -> Result<Vec<u8>> {
        Err(WHY)
    }
    pub fn set_metadata(_: &str) -> Result<()> {
        Err(WHY)
    }
}

/// The categories of what is allocated now, adding up to `allocated`: watched tensors (exact),
/// the optimizer state the phase markers measured, the session's cuBLAS workspace, and the rest.
fn allocated_by_category(allocated: u64) -> Vec<Category> {
    let known = watch::known_bytes(Device::Cuda(DEVICE as usize));
    let mut categories = categories::known(known);
    let optimizer_state = state::lock(&state::shared().phases).optimizer_state;
    if optimizer_state > 0 {
        categories.push(categories::optimizer_state(optimizer_state));
    }
    if let Some(start) = state::at_start().filter(|s| s.workspace > 0) {
        categories.push(Category {
            name: CategoryName::CudaContext,
            bytes: start.workspace,
            exact: true,
            how: "cuBLAS workspace allocated at session start".into(),
        });
    }
    let counted: u64 = categories.iter().map(|c| c.bytes).sum();
    categories.push(Category {
        name: CategoryName::Other,
        bytes: allocated.saturating_sub(counted),
        exact: false,
        how: "allocated bytes minus the categories above".into(),
    });
    categories
}

/// Starts recording `request`'s timeline (replacing one already running).
pub fn begin(request: TimelineRequest) -> Result<(), RuntimeError> {
    let mut capture = TimelineCapture {
        snapshot: request.snapshot.clone(),
        stacks: request.stacks,
        max_entries: request.max_entries,
        ..Default::default()
    };
    let result: Result<(), RuntimeError> = (|| {
        let stats = cuda_stats::device_stats(DEVICE).map_err(|why| {
            RuntimeError::Timeline(format!(
                "allocation timelines need CUDA (the caching allocator's history): {why}"
            ))
        })?;
        capture.at_start = stats.current;
        capture.start_categories = allocated_by_category(stats.current.allocated);
        capture.storages_at_start = watch::storages(DEVICE);
        history::start(request.max_entries, request.stacks)?;
        let _ = history::set_metadata("");
        capture.started_us = now_us();
        Ok(())
    })();
    if let Err(why) = &result {
        capture.error = Some(why.to_string());
    }
    *active() = Some(Active {
        request,
        capture,
        // Nothing to mark or stop when recording could not start.
        stopped: result.is_err(),
    });
    result
}

/// Starts a timeline from the kernel's request (JSON); a failure is reported with the cell's
/// record, not raised in the cell.
#[doc(hidden)]
pub fn begin_in_cell(request: &str) {
    match serde_json::from_str::<TimelineRequest>(request) {
        Ok(request) => {
            let _ = begin(request);
        }
        Err(why) => {
            *active() = Some(Active {
                request: TimelineRequest {
                    snapshot: String::new(),
                    stacks: false,
                    max_entries: 0,
                    steps: None,
                },
                capture: TimelineCapture {
                    error: Some(format!("bad timeline request: {why}")),
                    ..Default::default()
                },
                stopped: true,
            })
        }
    }
}

/// Writes the snapshot and stops recording.
fn stop(active: &mut Active) {
    if active.stopped || active.capture.error.is_some() {
        return;
    }
    active.stopped = true;
    let _ = history::set_metadata("");
    // The trace's times are taken when GPU work is queued; wait for it, so that the frees its
    // last kernels trigger are in.
    if tch::Cuda::is_available() {
        tch::Cuda::synchronize(DEVICE);
    }
    active.capture.ended_us = now_us();
    active.capture.storages_at_end = watch::storages(DEVICE);
    let written = history::snapshot()
        .map_err(|e| e.to_string())
        .and_then(|bytes| {
            std::fs::write(&active.request.snapshot, bytes)
                .map_err(|e| format!("could not write {}: {e}", active.request.snapshot))
        });
    if let Err(why) = written {
        active.capture.error = Some(why);
    }
    let _ = history::stop();
}

/// Notes that `phase` began (called by the `tchmem::phase` markers; nothing when no timeline
/// is recording).
pub(crate) fn mark(phase: Phase) {
    let mut guard = active();
    let Some(active) = guard.as_mut() else { return };
    if !active.stopped {
        mark_locked(active, phase);
    }
}

/// Notes the end of an optimizer step; stops recording after the requested number of steps.
pub(crate) fn step_ended() {
    let mut guard = active();
    let Some(active) = guard.as_mut() else { return };
    if active.stopped {
        return;
    }
    active.capture.steps += 1;
    let steps = active.capture.steps;
    if active.request.steps.is_some_and(|limit| steps >= limit) {
        active.capture.stopped_after_steps = Some(steps);
        stop(active);
    } else {
        mark_locked(active, Phase::Other);
    }
}

fn mark_locked(active: &mut Active, phase: Phase) {
    let _ = history::set_metadata(phase.tag());
    active.capture.phases.push(PhaseMark {
        phase,
        time_us: now_us(),
    });
}

/// Ends the timeline being recorded: writes the snapshot, stops recording and returns what was
/// captured (`None` when none was recording).
pub fn finish() -> Option<TimelineCapture> {
    let mut active = active().take()?;
    stop(&mut active);
    Some(active.capture)
}

extern "C" {
    fn tchmem_stack_frames(
        mode: std::ffi::c_int,
        sink: extern "C" fn(*mut std::ffi::c_void, *const std::ffi::c_char),
        context: *mut std::ffi::c_void,
        err: *mut std::ffi::c_char,
        err_len: usize,
    ) -> std::ffi::c_int;
}

/// One frame of a stack as libtorch symbolizes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StackFrame {
    /// The function, as the symbolizer names it.
    pub function: String,
    /// The source file (or the library, when there is no line table).
    pub file: String,
    /// The line (or an offset into the library).
    pub line: u64,
}

/// The calling thread's C++ stack, innermost first, unwound and symbolized by libtorch as its
/// allocation history does with `stacks="all"` (`TORCH_SYMBOLIZE_MODE`'s modes: "fast",
/// "addr2line", "dladdr"). Works without CUDA: the kernel's tests use it to check that frames in
/// a cell's code name the cell's lines.
pub fn stack_frames(mode: &str) -> Result<Vec<StackFrame>, RuntimeError> {
    extern "C" fn push(context: *mut std::ffi::c_void, frame: *const std::ffi::c_char) {
        // SAFETY: `context` is the Vec below; `frame` is a NUL-terminated string.
        unsafe {
            let frames = &mut *(context as *mut Vec<String>);
            frames.push(
                std::ffi::CStr::from_ptr(frame)
                    .to_string_lossy()
                    .into_owned(),
            );
        }
    }
    let mode = match mode {
        "fast" => 0,
        "addr2line" => 1,
        "dladdr" => 2,
        other => {
            return Err(RuntimeError::Invalid(format!(
                "unknown symbolize mode {other}: fast, addr2line or dladdr"
            )))
        }
    };
    let mut texts: Vec<String> = Vec::new();
    let context = &mut texts as *mut Vec<String> as *mut std::ffi::c_void;
    // SAFETY: the shim calls `push` with `context` before it returns.
    crate::ffi::call(|e, n| unsafe { tchmem_stack_frames(mode, push, context, e, n) })?;
    Ok(texts
        .iter()
        .map(|text| {
            let mut parts = text.splitn(3, '\t');
            StackFrame {
                function: parts.next().unwrap_or_default().to_string(),
                file: parts.next().unwrap_or_default().to_string(),
                line: parts.next().and_then(|l| l.parse().ok()).unwrap_or(0),
            }
        })
        .collect())
}
