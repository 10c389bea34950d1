//! Reading libtorch's memory snapshot: the pickle that `torch.cuda.memory._snapshot()` returns
//! and PyTorch's memory_viz opens (`torch/csrc/cuda/memory_snapshot.cpp` writes it). Only the
//! parts a timeline needs are read; unknown keys are ignored, so later libtorch versions that
//! add fields still load.

use super::pickle::{self, Value};

/// One stack frame of an allocation (with `--stacks`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Frame {
    /// The function (demangled).
    pub name: String,
    /// The source file, or "??" when the symbolizer found none.
    pub filename: String,
    /// The source line, 0 when unknown.
    pub line: i64,
}

/// One entry of the allocator's trace.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TraceEntry {
    /// `alloc`, `free_requested`, `free_completed`, `segment_alloc`, `segment_free`,
    /// `segment_map`, `segment_unmap`, `oom`, `snapshot`, …
    pub action: String,
    /// Block address (for `oom`: the device's free bytes).
    pub addr: u64,
    /// Bytes (rounded up by the allocator).
    pub size: u64,
    /// Microseconds since the Unix epoch.
    pub time_us: i64,
    /// The allocating stack, when stacks were recorded.
    pub frames: Vec<Frame>,
    /// What the program had set as the allocator's user metadata (tchmem: the phase).
    pub user_metadata: String,
}

/// The snapshot: the trace of every device (segments' current state is not needed).
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// One trace per device, in recording order.
    pub device_traces: Vec<Vec<TraceEntry>>,
}

/// Why a snapshot could not be read.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The file could not be read.
    #[error("could not read the snapshot {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// What went wrong.
        source: std::io::Error,
    },
    /// The bytes are not a snapshot pickle.
    #[error("{path} is not a memory snapshot pickle: {source}")]
    Format {
        /// The file.
        path: String,
        /// What the pickle reader said.
        source: pickle::PickleError,
    },
    /// A pickle, but not of a snapshot.
    #[error("{path} is a pickle but not a memory snapshot: {what}")]
    NotASnapshot {
        /// The file.
        path: String,
        /// What is missing.
        what: &'static str,
    },
}

fn text(value: &Value, key: &str) -> String {
    value
        .get(key)
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

fn int(value: &Value, key: &str) -> i64 {
    value.get(key).and_then(|v| v.as_int()).unwrap_or_default()
}

fn entry(value: &Value) -> TraceEntry {
    TraceEntry {
        action: text(value, "action"),
        addr: int(value, "addr") as u64,
        size: int(value, "size") as u64,
        time_us: int(value, "time_us"),
        frames: value
            .get("frames")
            .and_then(|f| f.items())
            .unwrap_or_default()
            .iter()
            .map(|frame| Frame {
                name: text(frame, "name"),
                filename: text(frame, "filename"),
                line: int(frame, "line"),
            })
            .collect(),
        user_metadata: text(value, "user_metadata"),
    }
}

/// Reads a snapshot pickle from bytes.
pub fn parse(bytes: &[u8], path: &str) -> Result<Snapshot, SnapshotError> {
    let value = pickle::read(bytes).map_err(|source| SnapshotError::Format {
        path: path.to_string(),
        source,
    })?;
    let traces =
        value
            .get("device_traces")
            .and_then(|t| t.items())
            .ok_or(SnapshotError::NotASnapshot {
                path: path.to_string(),
                what: "no device_traces",
            })?;
    Ok(Snapshot {
        device_traces: traces
            .iter()
            .map(|trace| {
                trace
                    .items()
                    .unwrap_or_default()
                    .iter()
                    .map(entry)
                    .collect()
            })
            .collect(),
    })
}

/// Reads the snapshot pickle at `path`.
pub fn read(path: &str) -> Result<Snapshot, SnapshotError> {
    let bytes = std::fs::read(path).map_err(|source| SnapshotError::Io {
        path: path.to_string(),
        source,
    })?;
    parse(&bytes, path)
}
