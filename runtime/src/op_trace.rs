//! Per-operator memory of a training step (csrc/op_trace.cpp): calibration trials record the
//! bytes each top-level operator began with and added while it ran, and the estimate runs the
//! operators that matter alone at the batch it predicts, so that a workspace cuDNN sizes per
//! shape is measured there rather than drawn on a line through two small batches.

use std::ffi::{c_char, c_int, c_void};

use tchmem_wire::op_trace::{OpCost, OpReplay, OpTrace, OP_REPLAY_MIME};

use crate::cuda_stats::DEVICE;
use crate::error::Result;
use crate::ffi::call;
use crate::state;

/// Recordings kept for a replay: the last few calibrations' (a few hundred operators each).
const KEPT: usize = 16;

extern "C" {
    fn tchmem_ops_start(
        cuda: c_int,
        device: c_int,
        log: *mut c_void,
        callback: *mut u64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tchmem_ops_remove(callback: u64);
    fn tchmem_ops_stop(
        recording: *mut *mut c_void,
        count: *mut usize,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tchmem_ops_free(recording: *mut c_void);
    fn tchmem_ops_get(
        recording: *const c_void,
        index: usize,
        name: *mut c_char,
        name_len: usize,
        start: *mut i64,
        excess: *mut i64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tchmem_ops_take_carried(allocated: *mut i64, reserved: *mut i64);
    fn tchmem_ops_replay(
        first: *const c_void,
        second: *const c_void,
        b1: i64,
        b2: i64,
        target: i64,
        pairs: *const usize,
        count: usize,
        cuda: c_int,
        device: c_int,
        excess: *mut i64,
        log: *mut c_void,
        context: *mut c_void,
        sizes: extern "C" fn(*mut c_void, usize, *const i64, usize),
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
}

/// Starts recording every top-level operator any thread runs, with the CUDA allocator's bytes
/// when CUDA is there (names and arguments only otherwise).
pub(crate) fn start() -> Result<()> {
    abandon();
    let cuda = tch::Cuda::is_available();
    let mut callback = 0u64;
    // Each operator's beginning and end marked in the allocator's events, when they are logged.
    let log = crate::alloc_trace::existing_log();
    // SAFETY: plain arguments, the process's log (or null), an out-pointer to a local and the
    // error buffer.
    call(|e, n| unsafe {
        tchmem_ops_start(cuda as c_int, DEVICE as c_int, log, &mut callback, e, n)
    })?;
    state::lock(&state::shared().op_recordings).recording = Some(callback);
    Ok(())
}

/// Removes the callback of a recording that was never stopped (the cell that started it failed
/// before its recorded step ended), so that no later operator pays for it. The kernel's child
/// calls it after every cell.
pub(crate) fn abandon() {
    if let Some(callback) = state::lock(&state::shared().op_recordings).recording.take() {
        // SAFETY: a handle libtorch gave; removing one twice is a no-op there.
        unsafe { tchmem_ops_remove(callback) };
    }
}

/// Stops recording; the operators in the order they ran. The recording is kept (the last
/// [`KEPT`]) under the trace's `id` for a replay.
pub(crate) fn stop() -> Result<OpTrace> {
    let (mut recording, mut count) = (std::ptr::null_mut::<c_void>(), 0usize);
    // SAFETY: out-pointers to locals and the error buffer.
    call(|e, n| unsafe { tchmem_ops_stop(&mut recording, &mut count, e, n) })?;
    state::lock(&state::shared().op_recordings).recording = None;
    let ops = (0..count)
        .map(|index| operator(recording, index))
        .collect::<Result<Vec<_>>>();
    let mut kept = state::lock(&state::shared().op_recordings);
    kept.next_id += 1;
    let id = kept.next_id;
    kept.kept.push_back((id, recording as usize));
    while kept.kept.len() > KEPT {
        if let Some((_, old)) = kept.kept.pop_front() {
            // SAFETY: made by tchmem_ops_stop and dropped from the list before it is freed.
            unsafe { tchmem_ops_free(old as *mut c_void) };
        }
    }
    Ok(OpTrace { id, ops: ops? })
}

fn operator(recording: *const c_void, index: usize) -> Result<OpCost> {
    let mut name = [0 as c_char; 256];
    let (mut start, mut excess) = (0i64, 0i64);
    // SAFETY: a live recording, a name buffer of its length, out-pointers to locals, the
    // error buffer.
    call(|e, n| unsafe {
        tchmem_ops_get(
            recording,
            index,
            name.as_mut_ptr(),
            name.len(),
            &mut start,
            &mut excess,
            e,
            n,
        )
    })?;
    // SAFETY: the shim NUL-terminates what it writes.
    let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) };
    Ok(OpCost {
        name: name.to_string_lossy().into_owned(),
        start: start.max(0) as u64,
        excess: excess.max(0) as u64,
    })
}

/// The allocator's peaks (allocated, reserved) that a recording restarted since the last
/// call: a run measuring its own peaks takes them back.
pub(crate) fn take_carried() -> (u64, u64) {
    let (mut allocated, mut reserved) = (0i64, 0i64);
    // SAFETY: out-pointers to locals; the function cannot fail.
    unsafe { tchmem_ops_take_carried(&mut allocated, &mut reserved) };
    (allocated.max(0) as u64, reserved.max(0) as u64)
}

/// Runs `f` with its operators recorded (a panic in `f` stops the recording and goes on).
pub fn record<T>(f: impl FnOnce() -> T) -> Result<(T, OpTrace)> {
    start()?;
    let value = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    let trace = stop();
    match value {
        Ok(value) => Ok((value, trace?)),
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

/// Runs operators of the recording `first` (made at batch `b1`; `second`, at `b2`, tells which
/// dimensions grow with the batch) alone at batch `target`, each given as its index in `first`
/// and in `second` (they differ where one step ran operators the other did not), and measures
/// what each allocated above what was there when it began (0 each without CUDA: they only run)
/// and the sizes it allocated. A failure as a whole is in the answer's `error`.
pub fn replay(
    first: u64,
    second: u64,
    (b1, b2): (u64, u64),
    target: u64,
    pairs: &[(usize, usize)],
) -> Replayed {
    match replay_all(first, second, (b1, b2), target, pairs) {
        Ok(answer) => Replayed(answer),
        Err(error) => Replayed(OpReplay {
            excess: vec![None; pairs.len()],
            allocations: Vec::new(),
            error: Some(error.to_string()),
        }),
    }
}

fn replay_all(
    first: u64,
    second: u64,
    (b1, b2): (u64, u64),
    target: u64,
    pairs: &[(usize, usize)],
) -> Result<OpReplay> {
    extern "C" fn sizes(context: *mut c_void, i: usize, bytes: *const i64, n: usize) {
        // SAFETY: `context` is the Vec below, of one item per index; `bytes` holds `n` items.
        unsafe {
            let out = &mut *(context as *mut Vec<Vec<u64>>);
            if let Some(slot) = out.get_mut(i) {
                *slot = crate::ffi::slice(bytes, n)
                    .iter()
                    .map(|&b| b.max(0) as u64)
                    .collect();
            }
        }
    }
    // Held while the operators run: no recording is dropped meanwhile (they record nothing).
    let kept = state::lock(&state::shared().op_recordings);
    let find = |id: u64| kept.kept.iter().find(|(k, _)| *k == id).map(|(_, r)| *r);
    let (Some(r1), Some(r2)) = (find(first), find(second)) else {
        return Err(crate::error::RuntimeError::NoOpRecording(first, second));
    };
    let flat: Vec<usize> = pairs.iter().flat_map(|&(i, j)| [i, j]).collect();
    let mut excess = vec![-1i64; pairs.len()];
    let mut allocations: Vec<Vec<u64>> = vec![Vec::new(); pairs.len()];
    let cuda = tch::Cuda::is_available();
    let log = crate::alloc_trace::existing_log();
    let context = &mut allocations as *mut Vec<Vec<u64>> as *mut c_void;
    // SAFETY: two live recordings, `flat` of twice `pairs.len()` elements and `excess` of
    // `pairs.len()`, the process's log (or null), the Vec above for the callback, the error
    // buffer.
    call(|e, n| unsafe {
        tchmem_ops_replay(
            r1 as *const c_void,
            r2 as *const c_void,
            b1 as i64,
            b2 as i64,
            target as i64,
            flat.as_ptr(),
            pairs.len(),
            cuda as c_int,
            DEVICE as c_int,
            excess.as_mut_ptr(),
            log,
            context,
            sizes,
            e,
            n,
        )
    })?;
    let excess = excess
        .into_iter()
        .map(|bytes| (bytes >= 0).then_some(bytes as u64))
        .collect();
    Ok(OpReplay {
        excess,
        allocations,
        error: None,
    })
}

/// A replay's measurements, shown to the kernel as [`OP_REPLAY_MIME`].
pub struct Replayed(pub OpReplay);

impl Replayed {
    /// evcxr's hook for showing a cell's value.
    pub fn evcxr_display(&self) {
        crate::display::json_result(OP_REPLAY_MIME, &self.0);
    }
}
