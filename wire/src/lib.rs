//! Messages that cross process boundaries inside tchmem.
//!
//! Three parties talk: the kernel process (engine), the child process that runs cells (its
//! hooks), and the code of the cells themselves (through `tchmem-runtime`). They are built
//! separately (cells are compiled at run time), so the formats live here, in one small crate
//! they all depend on.

pub mod alloc_trace;
pub mod compare;
pub mod estimate;
pub mod memory;
pub mod mime;
pub mod op_trace;
pub mod progress;
mod slot;
pub mod timeline;

pub use slot::{ChildSlot, CHILD_SLOT_SYMBOL};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// MIME type of the block the child prints after each cell; the engine removes it from the
/// cell's displayed outputs.
pub const CELL_REPORT_MIME: &str = "application/vnd.tchmem.cell-report+json";

/// The most ranks a `%%distributed` world may have: each is a process with its own libtorch
/// (the magic refuses more; the world's launcher keeps one slot per rank).
pub const MAX_RANKS: usize = 64;

/// Prefix of the stderr line that ends a cell's stderr; the cell's sync token follows it.
pub const STDERR_SYNC_PREFIX: &str = "TCHMEM_STDERR_SYNC ";

/// evcxr's rich output (a line `EVCXR_BEGIN_CONTENT <mime>`, the content, a line
/// `EVCXR_END_CONTENT`): defined beside the one thing every cell imports (the `tchmem-show`
/// crate, which prints a cell's final value that way).
pub use tchmem_show::{EVCXR_BEGIN_CONTENT, EVCXR_END_CONTENT};

/// Prefix of a stdout line that carries a [`CellMessage`] as one line of JSON.
pub const MESSAGE_PREFIX: &str = "TCHMEM_MSG ";

/// Whether a MIME type carries JSON (sent as JSON, not as text, in Jupyter bundles).
pub fn is_json_mime(mime: &str) -> bool {
    mime == "application/json" || mime.ends_with("+json")
}

/// A bundle value for `content` of type `mime`: JSON types are parsed (falling back to text
/// when the content is not valid JSON), others stay text.
pub fn bundle_value(mime: &str, content: &str) -> Value {
    if is_json_mime(mime) {
        if let Ok(value) = serde_json::from_str(content) {
            return value;
        }
    }
    Value::String(content.to_string())
}

/// The child's account of one cell.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CellReport {
    /// Unique per cell and child process; the same token ends the cell's stderr.
    pub sync_token: String,
    /// The cell panicked (evcxr caught it; variables defined by the cell were dropped).
    pub panicked: bool,
    /// Time spent in the cell's code, without compilation.
    pub wall_seconds: f64,
    /// Whether libtorch's CUDA library was loaded into the child, and if not, why.
    pub cuda_library: String,
    /// What the runtime measured; `None` when the runtime is not loaded (no tch) or failed.
    #[serde(default)]
    pub memory: Option<memory::MemoryRecord>,
    /// Why there is no memory record, when there is none.
    #[serde(default)]
    pub memory_missing: Option<String>,
    /// Time the child spent in the runtime's recording hooks for this cell (before + after).
    #[serde(default)]
    pub recording_seconds: f64,
    /// The allocation timeline recorded around the cell (`%%memprofile`), if one was.
    #[serde(default)]
    pub timeline: Option<timeline::TimelineCapture>,
    /// The loop an interrupt stopped the cell at (the cell then panicked on purpose: variables
    /// from earlier cells were kept).
    #[serde(default)]
    pub stopped: Option<progress::LoopCount>,
    /// The cell's own code saw an interrupt (`tchmem::interrupted()`) and ended as it chose.
    #[serde(default)]
    pub interrupt_seen: bool,
    /// In a `%%distributed` world: every rank's record, by rank (`None` for a rank whose
    /// runtime sent none); empty elsewhere. Rank 0's is also `memory`.
    #[serde(default)]
    pub rank_memory: Vec<Option<memory::MemoryRecord>>,
}

/// What the runtime's after-cell hook hands the child: the cell's memory record and, beside
/// it, the timeline recorded around the cell, if one was.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct AfterCell {
    /// The memory record.
    pub record: memory::MemoryRecord,
    /// The allocation timeline (`%%memprofile`).
    #[serde(default)]
    pub timeline: Option<timeline::TimelineCapture>,
}

/// Rich output sent from a cell while it runs (Jupyter's `display_data` or
/// `update_display_data`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Display {
    /// Representations by MIME type (text as strings, JSON types as JSON).
    pub data: Map<String, Value>,
    /// Per-MIME metadata.
    #[serde(default)]
    pub metadata: Map<String, Value>,
    /// Lets a later [`Display`] with `update` replace this one in place.
    #[serde(default)]
    pub display_id: Option<String>,
    /// Replace the output shown under `display_id` instead of adding one.
    #[serde(default)]
    pub update: bool,
}

/// What code in a cell tells the kernel while it runs, one stdout line each.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum CellMessage {
    /// Show rich output.
    Display(Display),
    /// Clear the cell's output (Jupyter's `clear_output`); with `wait`, when the next output
    /// arrives.
    ClearOutput {
        /// Clear only when new output arrives (avoids flicker in progress displays).
        wait: bool,
    },
    /// A block of rich output the cell printed the evcxr way (a line `EVCXR_BEGIN_CONTENT
    /// <mime>`, the content, a line `EVCXR_END_CONTENT`), taken out of stdout by the child. The
    /// engine shows it as a display, or as part of the cell's result when evcxr printed it to
    /// show the cell's final value.
    Content {
        /// The block's MIME type.
        mime: String,
        /// The lines between the markers, joined by newlines.
        content: String,
    },
    /// A sample of the running cell for the live view.
    Live(progress::LiveSample),
    /// A panic, reported by the hook the runtime installs instead of the default stderr text.
    Panic {
        /// The thread that panicked.
        thread: String,
        /// The panic payload, as text.
        message: String,
        /// `file:line:column`, when known.
        location: Option<String>,
    },
}

impl CellMessage {
    /// The stdout line that carries this message.
    pub fn to_line(&self) -> String {
        // serde_json escapes newlines, so the JSON is always one line. evcxr takes any stdout
        // line containing `EVCXR_BEGIN_CONTENT <word>` for the start of a block and swallows
        // what follows: inside the JSON's strings (the only place text can hold it) the marker is
        // written with an escaped `_`, which reads back the same.
        let json = serde_json::to_string(self).expect("a CellMessage always serializes");
        format!(
            "{MESSAGE_PREFIX}{}",
            json.replace(EVCXR_BEGIN_CONTENT, "EVCXR_BEGIN\\u005fCONTENT")
        )
    }

    /// Parses a stdout line; `None` if it is not a message line.
    pub fn from_line(line: &str) -> Option<Result<CellMessage, serde_json::Error>> {
        line.strip_prefix(MESSAGE_PREFIX)
            .map(serde_json::from_str::<CellMessage>)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_through_one_line() {
        let mut data = Map::new();
        data.insert("text/html".into(), "<b>a\nb</b>".into());
        let messages = [
            CellMessage::Display(Display {
                data,
                display_id: Some("progress".into()),
                ..Default::default()
            }),
            CellMessage::ClearOutput { wait: true },
            CellMessage::Content {
                mime: "text/html".into(),
                content: "<p>EVCXR_BEGIN_CONTENT text/html\\n</p>\nEVCXR_END_CONTENT".into(),
            },
            CellMessage::Panic {
                thread: "main".into(),
                message: "two\nlines".into(),
                location: Some("src/lib.rs:1:2".into()),
            },
        ];
        for message in messages {
            let line = message.to_line();
            assert!(!line.contains('\n'));
            assert!(!line.contains(EVCXR_BEGIN_CONTENT), "{line}");
            assert_eq!(CellMessage::from_line(&line).unwrap().unwrap(), message);
        }
        assert!(CellMessage::from_line("plain output").is_none());
    }
}
