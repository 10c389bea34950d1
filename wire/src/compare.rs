//! One run of a training loop under `%%optimize --compare`: what the child measured, sent to the
//! kernel as the cell's value under [`COMPARE_RUN_MIME`].

use serde::{Deserialize, Serialize};

use crate::memory::MemoryRecord;

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
    /// Allocator peaks since the run began (CUDA only).
    pub peak_allocated: Option<u64>,
    /// Peak reserved bytes since the run began (CUDA only).
    pub peak_reserved: Option<u64>,
    /// Allocated bytes at the end of the last step: parameters, gradients, optimizer state and
    /// whatever else outlives a step (CUDA only).
    pub allocated_after_step: Option<u64>,
    /// The memory record at the end of the last step (categories of watched VarStores).
    pub at_last_step: Option<MemoryRecord>,
}

impl CompareRun {
    /// Median step time after the first step (which pays for warm-up and lazy state), or the
    /// only step's time.
    pub fn typical_step_seconds(&self) -> Option<f64> {
        let mut times: Vec<f64> = if self.step_seconds.len() > 1 {
            self.step_seconds[1..].to_vec()
        } else {
            self.step_seconds.clone()
        };
        if times.is_empty() {
            return None;
        }
        times.sort_by(f64::total_cmp);
        Some(times[times.len() / 2])
    }
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
    }
}
