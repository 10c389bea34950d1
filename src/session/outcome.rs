//! What running a cell takes and gives: where its side output goes, and what it produced.

use std::collections::BTreeMap;
use std::sync::Arc;

use tchmem_wire::CellReport;

use super::completion::Candidate;
use super::streams::OutputSink;
use crate::cell_error::CellError;

/// Asks the user for a line of input: `(prompt, is_password) -> reply`.
pub type InputFn = Box<dyn Fn(&str, bool) -> String + Send>;

/// Where a running cell's side output goes.
pub struct CellIo {
    /// Stream output and displays, delivered while the cell runs.
    pub output: OutputSink,
    /// Answers input requests; `None` when the frontend does not allow stdin.
    pub input: Option<InputFn>,
}

impl CellIo {
    /// Output dropped, no input: for code the kernel runs for itself (set-up, probes, trials).
    pub fn quiet() -> CellIo {
        CellIo {
            output: Arc::new(|_| {}),
            input: None,
        }
    }
}

/// What one cell produced, besides its streams.
#[derive(Debug, Default)]
pub struct CellOutcome {
    /// The cell's rich result by MIME type (the value of its final expression, `:` command
    /// output); empty when there is none.
    pub data: BTreeMap<String, String>,
    /// Set when the cell failed (compile error, panic, crash, interrupt).
    pub error: Option<CellError>,
    /// The child's report of the run, when the cell's code ran.
    pub report: Option<CellReport>,
    /// The memory summary to show after the cell's result (per `%memprofile`).
    pub memory_display: Option<tchmem_wire::Display>,
    /// Help for a pager, by MIME type (`:help`, `:doc`, a magic's `--help`); empty when none.
    /// The kernel sends it as the execute reply's `page` payload, where JupyterLab shows it
    /// under the cell; `tchmem execute` writes it as the `display_data` output JupyterLab
    /// records for it.
    pub page: BTreeMap<String, String>,
}

impl CellOutcome {
    /// Takes the cell's result as a Jupyter bundle (JSON MIME types as JSON; an SVG as an
    /// HTML image too, see [`super::rich::with_svg_image`]).
    pub fn take_result(&mut self) -> serde_json::Map<String, serde_json::Value> {
        let mut result = bundle(std::mem::take(&mut self.data));
        super::rich::with_svg_image(&mut result);
        result
    }

    /// Takes the help for the pager as a Jupyter bundle.
    pub fn take_page(&mut self) -> serde_json::Map<String, serde_json::Value> {
        bundle(std::mem::take(&mut self.page))
    }
}

fn bundle(data: BTreeMap<String, String>) -> serde_json::Map<String, serde_json::Value> {
    data.into_iter()
        .map(|(mime, text)| {
            let value = tchmem_wire::bundle_value(&mime, &text);
            (mime, value)
        })
        .collect()
}

/// A completion answer: candidates replacing the characters `start..end` (in chars).
#[derive(Debug, Default)]
pub struct CompletionOutcome {
    /// Candidate texts.
    pub matches: Vec<String>,
    /// First replaced character (Unicode scalar index, as Jupyter counts).
    pub start: usize,
    /// One past the last replaced character.
    pub end: usize,
    /// What each match is (kind and signature), in the order of `matches`.
    pub candidates: Vec<Candidate>,
}

/// Documentation for the expression at a cursor.
#[derive(Debug, Default)]
pub struct InspectOutcome {
    /// Plain-text documentation; empty when nothing was found.
    pub plain: String,
    /// The same as HTML.
    pub html: String,
}
