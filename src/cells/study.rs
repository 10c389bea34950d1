//! Files kept for study: where `TCHMEM_TRIAL_TRACES` names a folder, each trial that recorded
//! the allocator's events and each replay of operators is written there as JSON, so that a miss
//! on the GPU machine can be taken apart on a machine without one. Best effort: a failed write
//! is logged and the magic goes on.

use std::sync::atomic::{AtomicUsize, Ordering};

use tchmem_wire::compare::CompareRun;
use tchmem_wire::op_trace::OpReplay;

use crate::fit::trial::{Outcome, Trial};

/// Files written by this process, for unique names across kinds.
static WRITTEN: AtomicUsize = AtomicUsize::new(0);

/// Writes `trial-<pid>-<n>.json`, in the form `src/fit/reserved.rs`'s tests read: batch,
/// rewrites, the bytes it began with and peaked at, the parameters, the trace, and every timed
/// step's seconds with the GPU's work in the profiled one. `again` marks the second run of a
/// trial under cuDNN's benchmark mode.
pub(super) fn keep_trial(trial: &Trial, run: &CompareRun, again: bool) {
    let Outcome::Ran(m) = &trial.outcome else {
        return;
    };
    let Some(trace) = &m.allocations else {
        return;
    };
    keep(
        "trial",
        &serde_json::json!({
            "batch": trial.batch,
            "rewrites": trial.options.flags(),
            "begin_allocated": m.begin,
            "peak_allocated": m.peak_allocated,
            "peak_reserved": m.peak_reserved,
            "parameters": m.parameters,
            "step_seconds": run.step_seconds,
            "gpu_busy_seconds": run.gpu_busy_seconds,
            // Under cuDNN's benchmark mode a trial runs twice; the second is the one measured.
            "cudnn_benchmark": run.cudnn_benchmark,
            "again": again,
            // Each operator's name and bytes: how two trials' operators pair (see
            // `fit::op_peak::OpLines::of`), and why where they do not.
            "ops": m.ops.as_ref().map(|ops| &ops.ops),
            "trace": &**trace,
        }),
    );
}

/// Writes `replay-<pid>-<n>.json`: the micro-batch an estimate replayed its heaviest operators
/// at, which operators (each one's index in the smaller and the larger trial's recording, as
/// the trial files list them), and what each measured: the bytes over its inputs and outputs
/// and the sizes it requested. With the trial files beside it, the estimate's reserved replay
/// can be rebuilt offline.
pub(super) fn keep_replay(micro: u64, pairs: &[(usize, usize)], answer: &OpReplay) {
    keep(
        "replay",
        &serde_json::json!({
            "micro_batch": micro,
            "pairs": pairs,
            "excess": answer.excess,
            "allocations": answer.allocations,
            "error": answer.error,
        }),
    );
}

fn keep(kind: &str, json: &serde_json::Value) {
    let Some(dir) = std::env::var_os("TCHMEM_TRIAL_TRACES") else {
        return;
    };
    let n = WRITTEN.fetch_add(1, Ordering::Relaxed);
    let path = std::path::Path::new(&dir).join(format!("{kind}-{}-{n}.json", std::process::id()));
    if let Err(error) = std::fs::write(&path, json.to_string()) {
        tracing::warn!("could not keep the {kind} in {}: {error}", path.display());
    }
}
