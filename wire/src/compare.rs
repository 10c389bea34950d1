//! One run of a training loop under `%%optimize --compare`: what the child measured, sent to the
//! kernel as the cell's value under [`COMPARE_RUN_MIME`].

use serde::{Deserialize, Serialize};

use crate::alloc_trace::AllocTrace;
use crate::estimate::ParamShape;
use crate::memory::MemoryRecord;
use crate::op_trace::OpTrace;

/// The MIME type of a [`CompareRun`] in a cell's outputs (taken out by the kernel).
pub const COMPARE_RUN_MIME: &str = "application/vnd.tchmem.compare-run+json";

/// Steps, losses, times and memory of one instrumented run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CompareRun {
    /// Optimizer steps the run was asked to make.
    pub steps_wanted: usize,
    /// The loss of each step, in order.
    pub losses: Vec<f64>,
    /// Wall time of each step in seconds (CUDA synchronised at each step's end).
    pub step_seconds: Vec<f64>,
    /// Bytes allocated when the run began: what the notebook already holds (data, other
    /// models), which both runs share (CUDA only).
    #[serde(default)]
    pub allocated_at_begin: Option<u64>,
    /// Allocator peaks since the run began (CUDA only).
    pub peak_allocated: Option<u64>,
    /// Peak reserved bytes since the run began (CUDA only).
    pub peak_reserved: Option<u64>,
    /// Allocated bytes that outlive a step: parameters, gradients, optimizer state and whatever
    /// else the loop keeps, read when the last step that followed another began (at its forward
    /// marker, the previous step's locals gone), else at the end of the last step (CUDA only).
    pub allocated_after_step: Option<u64>,
    /// The memory record at the end of the last step (categories of watched VarStores).
    pub at_last_step: Option<MemoryRecord>,
    /// The trainable parameters of the watched VarStores at the first step, from which the
    /// kernel computes parameter, gradient and optimizer-state bytes exactly (the stores are
    /// gone by the time the run finishes).
    #[serde(default)]
    pub parameters: Vec<ParamShape>,
    /// The highest allocated bytes within each phase of the training step over the whole run,
    /// from the `tchmem::phase` markers (CUDA only, and only when the loop has markers).
    #[serde(default)]
    pub phase_peaks: Option<PhasePeaks>,
    /// The operators of the last step, when the run recorded them (calibration trials on CUDA).
    #[serde(default)]
    pub ops: Option<OpTrace>,
    /// The allocator's events from the run's beginning to the end of its recorded step, when it
    /// recorded operators on CUDA.
    #[serde(default)]
    pub allocations: Option<AllocTrace>,
    /// How long the GPU worked in one step past the timed ones (its kernels, copies and
    /// memsets, profiled), when the run recorded operators on CUDA and the profiler reported
    /// any: the work a step's wall time hides where launching kernels takes longer.
    #[serde(default)]
    pub gpu_busy_seconds: Option<f64>,
    /// The optimizer step's part of a step, in seconds, where the loop marks it
    /// (`tchmem::phase::step`): from the marker, once the GPU had done the work before it, to
    /// the step's end, in one step after the profiled one (runs that record their operators;
    /// none where the loop ends first). It runs once per step however many micro-batches the
    /// step adds up.
    #[serde(default)]
    pub optimizer_step_seconds: Vec<f64>,
    /// Whether cuDNN's benchmark mode was on (CUDA only): the first step at each shape the
    /// process had not run then timed cuDNN's algorithms.
    #[serde(default)]
    pub cudnn_benchmark: bool,
    /// Set by the kernel, not the runtime: when `--compare` ran this side again under
    /// benchmark mode (on the algorithms cuDNN chose), the first run's peak reserved bytes,
    /// which its timing of those algorithms set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_run_peak_reserved: Option<u64>,
}

/// Peak allocated bytes per phase of a training step, over a run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PhasePeaks {
    /// From `phase::forward` to `phase::step`: the forward pass, the loss and the backward pass,
    /// where activations and gradients meet.
    pub forward_backward: u64,
    /// From `phase::step` to `phase::end`: the optimizer step, where its state and temporaries
    /// meet the gradients.
    pub step: u64,
}

impl CompareRun {
    /// The peak the run itself added to what was allocated when it began.
    pub fn peak_above_begin(&self) -> Option<u64> {
        Some(
            self.peak_allocated?
                .saturating_sub(self.allocated_at_begin.unwrap_or(0)),
        )
    }

    /// What a step leaves allocated, beyond what was allocated when the run began: parameters,
    /// gradients, optimizer state.
    pub fn kept_above_begin(&self) -> Option<u64> {
        Some(
            self.allocated_after_step?
                .saturating_sub(self.allocated_at_begin.unwrap_or(0)),
        )
    }

    /// The fastest and slowest step after the first (the spread behind the median).
    pub fn step_range_seconds(&self) -> Option<(f64, f64)> {
        let times = self.step_seconds.get(1..).filter(|t| !t.is_empty())?;
        Some(
            times
                .iter()
                .fold((f64::MAX, f64::MIN), |(lo, hi), &t| (lo.min(t), hi.max(t))),
        )
    }

    /// Median step time after the first step (which pays for warm-up and lazy state), or the
    /// only step's time.
    pub fn typical_step_seconds(&self) -> Option<f64> {
        typical(&self.step_seconds)
    }

    /// The optimizer step's part of a typical step (see [`Self::optimizer_step_seconds`]),
    /// taken as the step times are.
    pub fn typical_optimizer_step_seconds(&self) -> Option<f64> {
        typical(&self.optimizer_step_seconds)
    }
}

/// The median after the first (which pays for warm-up and lazy state), or the only one. Of an
/// even count, the mean of the middle two: a trial times two steps, and taking the upper one
/// made its typical step its slowest (char_rnn's steps on an H100 ran 8-47 ms at one batch,
/// `results/gpu/2026-12-06-corpus/`).
fn typical(seconds: &[f64]) -> Option<f64> {
    let mut times: Vec<f64> = seconds
        .get(1..)
        .filter(|rest| !rest.is_empty())
        .unwrap_or(seconds)
        .to_vec();
    if times.is_empty() {
        return None;
    }
    times.sort_by(f64::total_cmp);
    let middle = times.len() / 2;
    Some(if times.len().is_multiple_of(2) {
        (times[middle - 1] + times[middle]) / 2.0
    } else {
        times[middle]
    })
}

#[cfg(test)]
mod tests {
    use super::CompareRun;

    #[test]
    fn typical_step_time_skips_the_warm_up_step() {
        let run = CompareRun {
            step_seconds: vec![5.0, 0.2, 0.1, 0.3],
            ..Default::default()
        };
        assert_eq!(run.typical_step_seconds(), Some(0.2));
        assert_eq!(CompareRun::default().typical_step_seconds(), None);
        let one = CompareRun {
            optimizer_step_seconds: vec![0.04],
            ..Default::default()
        };
        assert_eq!(one.typical_optimizer_step_seconds(), Some(0.04));
        assert_eq!(run.typical_optimizer_step_seconds(), None);
        assert_eq!(run.step_range_seconds(), Some((0.1, 0.3)));
        // Two timed steps (a trial's): their mean, not the slower one.
        let two = CompareRun {
            step_seconds: vec![0.4, 0.01, 0.05],
            ..Default::default()
        };
        assert!((two.typical_step_seconds().unwrap() - 0.03).abs() < 1e-12);
    }

    #[test]
    fn peaks_are_counted_above_what_the_notebook_already_held() {
        let run = CompareRun {
            allocated_at_begin: Some(100),
            peak_allocated: Some(160),
            allocated_after_step: Some(130),
            ..Default::default()
        };
        assert_eq!(run.peak_above_begin(), Some(60));
        assert_eq!(run.kept_above_begin(), Some(30));
        // Runs recorded before the field existed count from zero.
        let old: CompareRun = serde_json::from_str(
            r#"{"steps_wanted":1,"losses":[],"step_seconds":[],"peak_allocated":5,
                "peak_reserved":null,"allocated_after_step":null,"at_last_step":null}"#,
        )
        .unwrap();
        assert_eq!(old.peak_above_begin(), Some(5));
    }
}
