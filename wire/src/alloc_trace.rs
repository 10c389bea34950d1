//! The CUDA caching allocator's own events over a calibration trial, from which the memory
//! estimate predicts reserved memory: the kernel replays the events it predicts for another
//! batch through a model of the allocator's rules (rounding, pools, segment sizes, splitting).

use serde::{Deserialize, Serialize};

/// Every allocation and free the allocator served over a run, with the segments it held when the
/// run began. Allocations are numbered in order: the blocks in use in `segments` first, then
/// those of `events`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocTrace {
    /// The segments held when the run began, in address order.
    pub segments: Vec<Segment>,
    /// In order: `n > 0` is an allocation of `n` bytes (as requested, before rounding), `-(k +
    /// 1)` the free of allocation `k`.
    pub events: Vec<i64>,
    /// Where each top-level operator of the run's recorded step began and ended: `(operator
    /// index, events before that point)`, the index `-1` marking an end.
    #[serde(default)]
    pub marks: Vec<(i64, usize)>,
}

/// One segment (one `cudaMalloc`) held when a run began.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    /// In the large-block pool (allocations over 1 MiB), else in the small one.
    pub large: bool,
    /// Its blocks in address order: (bytes, in use).
    pub blocks: Vec<(u64, bool)>,
}

/// One event of an [`AllocTrace`], decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllocEvent {
    /// An allocation of this many bytes, as requested.
    Alloc(u64),
    /// The free of the allocation with this number.
    Free(usize),
}

impl AllocEvent {
    /// Decodes one of [`AllocTrace::events`].
    pub fn of(code: i64) -> AllocEvent {
        if code > 0 {
            AllocEvent::Alloc(code as u64)
        } else {
            AllocEvent::Free((-code - 1) as usize)
        }
    }
}

impl AllocTrace {
    /// Blocks in use when the run began (they take the first allocation numbers).
    pub fn blocks_in_use_at_begin(&self) -> usize {
        self.segments
            .iter()
            .map(|s| s.blocks.iter().filter(|(_, used)| *used).count())
            .sum()
    }

    /// The events, decoded.
    pub fn decoded(&self) -> impl Iterator<Item = AllocEvent> + '_ {
        self.events.iter().map(|&code| AllocEvent::of(code))
    }
}
