//! What the runtime hands the kernel about a cell's allocation timeline. The trace itself (every
//! alloc and free, with times and, on request, stacks) is in libtorch's snapshot pickle, written
//! to a file; this says where it is and what the runtime knew around it: which blocks held
//! watched tensors, what was allocated when recording began, and when each training phase began.

use serde::{Deserialize, Serialize};

use crate::memory::{Category, CategoryName, Counters};

/// How a timeline is to be recorded (from `%%memprofile`'s flags).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct TimelineRequest {
    /// Where the runtime writes libtorch's snapshot pickle.
    pub snapshot: String,
    /// Keep each allocation's C++ stack.
    pub stacks: bool,
    /// The most trace entries kept (a ring: older ones are dropped).
    pub max_entries: u64,
    /// Stop recording after this many optimizer steps (`tchmem::phase` marks), if set.
    pub steps: Option<u32>,
}

/// A training phase, as the `tchmem::phase` markers (and `%%optimize` rewrites) mark it.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Making or moving the input batch.
    Data,
    /// The forward pass (up to the loss).
    Forward,
    /// The backward pass.
    Backward,
    /// The optimizer step.
    Step,
    /// Anything after a step ended and before the next phase.
    Other,
}

impl Phase {
    /// All phases, in training order.
    pub const ALL: [Phase; 5] = [
        Phase::Data,
        Phase::Forward,
        Phase::Backward,
        Phase::Step,
        Phase::Other,
    ];

    /// The word the allocator's trace entries carry as `user_metadata` during this phase (for
    /// PyTorch's viewer; tchmem tells phases by time, see the kernel's `timeline::model`).
    pub fn tag(self) -> &'static str {
        match self {
            Phase::Data => "tchmem:data",
            Phase::Forward => "tchmem:forward",
            Phase::Backward => "tchmem:backward",
            Phase::Step => "tchmem:step",
            Phase::Other => "",
        }
    }

    /// Human label.
    pub fn label(self) -> &'static str {
        match self {
            Phase::Data => "data",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Step => "optimizer step",
            Phase::Other => "other",
        }
    }
}

/// When a phase began (microseconds since the Unix epoch, the trace's clock).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct PhaseMark {
    /// The phase that began.
    pub phase: Phase,
    /// When.
    pub time_us: i64,
}

/// A block of device memory that holds a watched tensor.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct Storage {
    /// Address of the tensor's storage (the allocator block's address).
    pub address: u64,
    /// Bytes of the tensor.
    pub bytes: u64,
    /// What it is: parameters, gradients or input batch.
    pub category: CategoryName,
}

/// What the runtime recorded for one cell's timeline.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct TimelineCapture {
    /// The snapshot pickle (libtorch's `_memory_snapshot_pickled`), as written.
    pub snapshot: String,
    /// Whether allocations kept their C++ stacks.
    pub stacks: bool,
    /// The ring's size.
    pub max_entries: u64,
    /// When recording began and ended (µs since the epoch).
    pub started_us: i64,
    /// When recording ended.
    pub ended_us: i64,
    /// The allocator's counters when recording began.
    pub at_start: Counters,
    /// What was allocated when recording began, by category (they add up to
    /// `at_start.allocated`).
    pub start_categories: Vec<Category>,
    /// Watched tensors' blocks when recording began.
    pub storages_at_start: Vec<Storage>,
    /// Watched tensors' blocks when recording ended.
    pub storages_at_end: Vec<Storage>,
    /// Phase marks in time order.
    pub phases: Vec<PhaseMark>,
    /// Optimizer steps seen while recording.
    pub steps: u32,
    /// Recording stopped early after this many steps (`--steps`).
    pub stopped_after_steps: Option<u32>,
    /// Why there is no trace, when recording failed (no CUDA, no history in this libtorch).
    pub error: Option<String>,
}

/// MIME type of a timeline capture in a cell's outputs.
pub const TIMELINE_MIME: &str = "application/vnd.tchmem.timeline+json";
