//! What each operator of one training step allocated (recorded in a calibration trial on
//! CUDA), and what some of them allocate when run alone at another batch: the memory estimate's
//! per-operator lines (`%memestimate`).

use serde::{Deserialize, Serialize};

/// The MIME type of an [`OpReplay`] in a cell's outputs (taken out by the kernel).
pub const OP_REPLAY_MIME: &str = "application/vnd.tchmem.op-replay+json";

/// The top-level operators of one training step, in the order they ran (the child keeps their
/// arguments under `id` for a replay).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpTrace {
    /// The recording's identifier in the child.
    pub id: u64,
    /// Each operator's bytes.
    pub ops: Vec<OpCost>,
}

/// One operator's bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpCost {
    /// The operator (`aten::convolution_backward`).
    pub name: String,
    /// Bytes allocated when it began.
    pub start: u64,
    /// How far above `start` allocation went while it ran (its outputs, temporaries and
    /// workspace).
    pub excess: u64,
}

/// Operators replayed alone at a batch: each one's excess, `None` for one that could not run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpReplay {
    /// In the order asked for.
    pub excess: Vec<Option<u64>>,
    /// In the same order, the sizes each one allocated while it ran, as requested (empty
    /// without CUDA or for one that could not run).
    #[serde(default)]
    pub allocations: Vec<Vec<u64>>,
    /// Why none ran, when the replay failed as a whole.
    #[serde(default)]
    pub error: Option<String>,
}
