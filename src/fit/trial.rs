//! One trial: the training cell run for a few optimizer steps at one batch size under one set of
//! rewrites, and what it measured.

use std::sync::Arc;

use tchmem_wire::alloc_trace::AllocTrace;
use tchmem_wire::compare::CompareRun;
use tchmem_wire::estimate::ParamShape;
use tchmem_wire::op_trace::OpTrace;

use crate::rewrite::Options;

/// What a trial measured (CUDA: every byte count comes from the caching allocator).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Measured {
    /// Whether the allocator's counters were there (CUDA); without them every byte count is 0
    /// and only the parameters, times and losses are known.
    pub cuda: bool,
    /// Bytes allocated when the trial began (what the notebook already held).
    pub begin: u64,
    /// Peak allocated bytes over the trial.
    pub peak_allocated: u64,
    /// Peak reserved bytes over the trial (what the allocator took from the device).
    pub peak_reserved: u64,
    /// Peak allocated bytes in forward + backward, when the loop marks its phases.
    pub forward_backward: Option<u64>,
    /// Peak allocated bytes in the optimizer step, when the loop marks its phases.
    pub step: Option<u64>,
    /// Median step time after the first step, in seconds.
    pub step_seconds: f64,
    /// The fastest and slowest step after the first, in seconds (the median twice when only
    /// one step was timed).
    pub step_range: (f64, f64),
    /// How long the GPU worked in the trial's profiled step (its kernels, copies and memsets),
    /// when it profiled one (CUDA): at a launch-bound batch, less than the step's wall time.
    pub gpu_busy_seconds: Option<f64>,
    /// The optimizer step's part of a typical step, where the loop marked it: what a step runs
    /// once however many micro-batches it adds up.
    pub optimizer_step_seconds: Option<f64>,
    /// The loss of each step.
    pub losses: Vec<f64>,
    /// The model's trainable parameters.
    pub parameters: Vec<ParamShape>,
    /// The last step's operators and their bytes, when the trial recorded them (CUDA).
    pub ops: Option<OpTrace>,
    /// The allocator's events from the trial's beginning to the end of its recorded step,
    /// when it recorded its operators (CUDA). Shared: calibrations copy their points, and a
    /// trace holds thousands of events.
    pub allocations: Option<Arc<AllocTrace>>,
    /// Under cuDNN's benchmark mode, the peaks of a first run at the trial's batch, whose first
    /// steps timed cuDNN's algorithms; the counts above are from a run right after it, on the
    /// algorithms cuDNN chose (see `cells::trial`).
    pub algorithm_search: Option<AlgorithmSearch>,
}

/// The allocator's peaks over a run in which cuDNN timed its algorithms (benchmark mode).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AlgorithmSearch {
    /// Peak allocated bytes of that run.
    pub peak_allocated: u64,
    /// Peak reserved bytes of that run.
    pub peak_reserved: u64,
}

impl Measured {
    /// Whether the run may have timed cuDNN's algorithms: benchmark mode times convolutions'
    /// only (ATen reads the flag in its convolution parameters alone), so a run whose recorded
    /// operators hold none did not. Without a recording this cannot be told: `true`.
    pub fn may_have_timed_convolutions(&self) -> bool {
        self.ops.as_ref().is_none_or(|trace| {
            trace.ops.iter().any(|op| {
                let name = op.name.trim_start_matches("aten::");
                name.contains("conv") && !name.contains("convert")
            })
        })
    }

    /// The measurements of a compare run; `None` if it made no step.
    pub fn of(run: &CompareRun) -> Option<Measured> {
        let typical = run.typical_step_seconds()?;
        Some(Measured {
            cuda: run.peak_allocated.is_some(),
            begin: run.allocated_at_begin.unwrap_or(0),
            peak_allocated: run.peak_allocated.unwrap_or(0),
            peak_reserved: run.peak_reserved.unwrap_or(0),
            forward_backward: run.phase_peaks.as_ref().map(|p| p.forward_backward),
            step: run.phase_peaks.as_ref().map(|p| p.step),
            step_seconds: typical,
            step_range: run.step_range_seconds().unwrap_or((typical, typical)),
            gpu_busy_seconds: run.gpu_busy_seconds,
            optimizer_step_seconds: run.typical_optimizer_step_seconds(),
            losses: run.losses.clone(),
            parameters: run.parameters.clone(),
            ops: run.ops.clone(),
            allocations: run.allocations.clone().map(Arc::new),
            algorithm_search: None,
        })
    }
}

/// How a trial ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// It ran its steps (boxed: the measurements are far larger than the other variants).
    Ran(Box<Measured>),
    /// The allocator ran out of memory (its OOM counter or observer said so).
    OutOfMemory,
    /// Anything else: the error's name and first line.
    Failed(String),
}

impl Outcome {
    /// The measurements, if it ran.
    pub fn measured(&self) -> Option<&Measured> {
        match self {
            Outcome::Ran(measured) => Some(measured.as_ref()),
            _ => None,
        }
    }
}

/// One trial: which configuration, at which batch, and how it went.
#[derive(Debug, Clone, PartialEq)]
pub struct Trial {
    /// The rewrites applied (empty: the loop as written).
    pub options: Options,
    /// The cell's batch size (with `--accumulate K`, each micro-batch is a K-th of it).
    pub batch: u64,
    /// How it went.
    pub outcome: Outcome,
}
