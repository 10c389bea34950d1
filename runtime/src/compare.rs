//! Measuring a training loop for `%%optimize --compare`: the kernel runs the original and the
//! rewritten loop, each instrumented to call [`record_step`] after every optimizer step and to
//! stop after a number of steps, between [`begin`] and [`finish`] in one cell.

use std::sync::Mutex;
use std::time::Instant;

use tch::Tensor;
use tchmem_wire::compare::{CompareRun, COMPARE_RUN_MIME};

use crate::{cuda_stats, record};

struct State {
    run: CompareRun,
    last: Instant,
}

// One cell runs begin, the loop and finish: a cell's own copy of this static is enough.
static STATE: Mutex<Option<State>> = Mutex::new(None);

fn state() -> std::sync::MutexGuard<'static, Option<State>> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

fn synchronize() {
    if tch::Cuda::is_available() {
        tch::Cuda::synchronize(record::DEVICE);
    }
}

/// The seed both runs of a comparison start from.
pub const SEED: i64 = 0;

/// Starts a run of `steps` steps: seeds libtorch's generators with [`SEED`] (both versions
/// initialise the same weights and draw the same dropout masks, so their losses can be compared
/// step by step), frees the allocator's cache and resets its peaks, so that runs measured one
/// after the other start alike.
pub fn begin(steps: usize) {
    tch::manual_seed(SEED);
    synchronize();
    let _ = cuda_stats::empty_cache();
    let _ = cuda_stats::reset_peak_stats(record::DEVICE);
    let allocated_at_begin = cuda_stats::device_stats(record::DEVICE)
        .ok()
        .map(|stats| stats.current.allocated);
    *state() = Some(State {
        run: CompareRun {
            steps_wanted: steps,
            allocated_at_begin,
            ..Default::default()
        },
        last: Instant::now(),
    });
}

/// Notes one optimizer step and its loss; true once the run has its steps (the loop stops).
/// Outside a run it does nothing and returns false.
pub fn record_step(loss: &Tensor) -> bool {
    let mut guard = state();
    let Some(state) = guard.as_mut() else {
        return false;
    };
    // The loss value waits for the step's kernels, so the time is the step's.
    let value = loss.double_value(&[]);
    synchronize();
    let now = Instant::now();
    state.run.losses.push(value);
    state
        .run
        .step_seconds
        .push(now.duration_since(state.last).as_secs_f64());
    let done = state.run.losses.len() >= state.run.steps_wanted;
    // After every step, so that a loop with fewer steps than asked still has its numbers.
    measure(&mut state.run);
    // Measuring is not part of the next step's time.
    state.last = Instant::now();
    done
}

/// The allocator's peaks and what a step leaves allocated, as of now.
fn measure(run: &mut CompareRun) {
    if let Ok(stats) = cuda_stats::device_stats(record::DEVICE) {
        run.peak_allocated = Some(stats.peak.allocated);
        run.peak_reserved = Some(stats.peak.reserved);
        run.allocated_after_step = Some(stats.current.allocated);
    }
    run.at_last_step = Some(record::current());
}

/// Ends the run; the value shows as the run's measurements (the kernel reads them).
pub fn finish() -> Finished {
    Finished(state().take().map(|s| s.run).unwrap_or_default())
}

/// A finished run, shown to the kernel as [`COMPARE_RUN_MIME`].
pub struct Finished(pub CompareRun);

impl Finished {
    /// evcxr's hook for showing a cell's value.
    pub fn evcxr_display(&self) {
        let json = serde_json::to_string(&self.0).unwrap_or_default();
        println!("EVCXR_BEGIN_CONTENT {COMPARE_RUN_MIME}\n{json}\nEVCXR_END_CONTENT");
    }
}
