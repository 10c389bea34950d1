//! `%%optimize`: rewrite the cell's training loop, show the code, then run it, or run the
//! original and the rewritten loop for a few steps each and compare them.

use std::sync::Arc;

use serde_json::{Map, Value};
use tchmem_wire::compare::{CompareRun, COMPARE_RUN_MIME};
use tchmem_wire::Display;

use super::errors::CellError;
use super::session::Session;
use super::streams::{CellOutput, StreamName};
use super::{CellIo, CellOutcome};
use crate::magics::optimize::OptimizeRequest;
use crate::magics::CellMagicSource;
use crate::report::compare::{comparison_display, Side};
use crate::rewrite::{self, Refusal};

/// The error for a loop the rewriter will not touch: what it looked for, on which line of the
/// cell, and where the patterns are described.
fn refused(refusal: Refusal, body_offset: usize) -> CellError {
    CellError::new(
        "RewriteRefused",
        format!(
            "%%optimize did not rewrite this cell: {}\nNothing was run. `%%optimize --help` lists \
             the loops it understands.",
            refusal.shifted(body_offset)
        ),
    )
}

/// The rewritten code as a rich output (a Rust code block, with what changed).
fn code_display(flags: &str, code: &str, changes: &[String]) -> Display {
    let changes_md: String = changes.iter().map(|c| format!("- {c}\n")).collect();
    let markdown =
        format!("**%%optimize {flags}** rewrote the cell:\n\n{changes_md}\n```rust\n{code}\n```\n");
    let mut data = Map::new();
    data.insert("text/markdown".into(), Value::String(markdown));
    data.insert(
        "text/plain".into(),
        Value::String(format!("%%optimize {flags}\n{changes_md}\n{code}")),
    );
    Display {
        data,
        ..Default::default()
    }
}

/// The cell that runs one instrumented version for `steps` steps, in a block so that it leaves
/// no variables behind, and returns the measurements as its value.
fn compare_cell(instrumented: &str, steps: u32) -> String {
    format!("tchmem::compare::begin({steps});\n{{\n{instrumented}\n}}\ntchmem::compare::finish()\n")
}

impl Session {
    /// Runs a `%%optimize` cell.
    pub(super) fn optimize(
        &mut self,
        request: &OptimizeRequest,
        source: &CellMagicSource<'_>,
        io: CellIo,
    ) -> CellOutcome {
        let fail = |error| CellOutcome {
            error: Some(error),
            ..Default::default()
        };
        let rewritten = match rewrite::rewrite(source.body, &request.options) {
            Ok(rewritten) => rewritten,
            Err(refusal) => return fail(refused(refusal, source.body_offset)),
        };
        let flags = request.options.flags();
        (io.output)(CellOutput::Display(code_display(
            &flags,
            &rewritten.code,
            &rewritten.changes,
        )));
        if request.show {
            return CellOutcome::default();
        }
        let Some(steps) = request.compare else {
            return self.run_cell_code(&rewritten.code, io);
        };
        let mut sides = Vec::new();
        for (name, code) in [("original", source.body), ("rewritten", &rewritten.code)] {
            let instrumented = match rewrite::instrument_for_compare(code) {
                Ok(instrumented) => instrumented,
                Err(refusal) => return fail(refused(refusal, source.body_offset)),
            };
            (io.output)(CellOutput::Stream(
                StreamName::Stdout,
                format!("── {name}: {steps} step(s) ──\n"),
            ));
            let outcome = self.run_cell_code(
                &compare_cell(&instrumented, steps),
                CellIo {
                    output: Arc::clone(&io.output),
                    input: None,
                },
            );
            sides.push(measured(outcome));
        }
        let rewritten_side = sides.pop().unwrap_or_else(|| Err("not run".into()));
        let original_side = sides.pop().unwrap_or_else(|| Err("not run".into()));
        (io.output)(CellOutput::Display(comparison_display(
            &flags,
            &original_side,
            &rewritten_side,
        )));
        CellOutcome::default()
    }
}

/// The measurements of one compare run, or why there are none.
fn measured(outcome: CellOutcome) -> Side {
    if let Some(error) = outcome.error {
        return Err(format!("{}: {}", error.ename, first_line(&error.evalue)));
    }
    outcome
        .data
        .iter()
        .find(|(mime, _)| mime.as_str() == COMPARE_RUN_MIME)
        .and_then(|(_, json)| serde_json::from_str::<CompareRun>(json).ok())
        .filter(|run| !run.losses.is_empty())
        .ok_or_else(|| "no training step was recorded (the loop ran no optimizer step)".to_string())
}

fn first_line(text: &str) -> &str {
    text.lines().next().unwrap_or_default()
}
