//! `%%optimize`: rewrite the cell's training loop, show the code, then run it, or run the
//! original and the rewritten loop for a few steps each and compare them.

use std::sync::Arc;

use serde_json::{Map, Value};
use tchmem_wire::compare::{CompareRun, COMPARE_RUN_MIME};
use tchmem_wire::Display;

use super::{fail, Cells, Runner};
use crate::magics::optimize::OptimizeRequest;
use crate::magics::CellMagicSource;
use crate::report::compare::{comparison_display, Side, SideFailure};
use crate::rewrite::{self, Change, Refusal};
use crate::session::{CellError, CellIo, CellOutcome, CellOutput, ErrorName, StreamName};

/// The error for a loop the rewriter will not touch: what it looked for, on which line of the
/// cell, and where the patterns are described.
fn refused(refusal: Refusal, body_offset: usize) -> CellError {
    CellError::new(
        ErrorName::RewriteRefused,
        format!(
            "%%optimize did not rewrite this cell: {}\nNothing was run. `%%optimize --help` lists \
             the loops it understands.",
            refusal.shifted(body_offset)
        ),
    )
}

/// Where a compare run's code comes from, for the line numbers of a refusal.
#[derive(Clone, Copy)]
enum CodeOrigin {
    /// The cell's own body, starting this many lines below the magic line.
    Cell { body_offset: usize },
    /// The rewritten code shown above (its own line numbers).
    Rewritten,
}

impl CodeOrigin {
    fn refused(self, refusal: Refusal) -> CellError {
        match self {
            CodeOrigin::Cell { body_offset } => refused(refusal, body_offset),
            CodeOrigin::Rewritten => CellError::new(
                ErrorName::RewriteRefused,
                format!(
                    "%%optimize --compare could not time the rewritten code shown above (line \
                     numbers are the rewritten code's): {refusal}\nThe original loop ran; the \
                     rewritten one did not."
                ),
            ),
        }
    }
}

/// The rewritten code as a rich output (a Rust code block, with what changed).
pub(super) fn code_display(flags: &str, code: &str, changes: &[Change]) -> Display {
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
/// no variables behind (whatever its last expression's type), and returns the measurements as
/// its value. evcxr's `:` commands stay at the top of the cell, where evcxr reads them.
pub(super) fn compare_cell(instrumented: &str, steps: u32) -> String {
    let (commands, code): (Vec<&str>, Vec<&str>) = instrumented
        .lines()
        .partition(|line| line.trim_start().starts_with(':'));
    format!(
        "{}\ntchmem::compare::begin({steps});\nlet _ = {{\n{}\n}};\ntchmem::compare::finish()\n",
        commands.join("\n"),
        code.join("\n")
    )
}

/// Why `--compare` would mislead on this cell, if it would: both runs must start from fresh
/// weights, so the VarStore must be made in the cell (a model from an earlier cell would be
/// trained by the first run and handed, trained, to the second).
pub(super) fn compare_misleads(body: &str) -> Option<String> {
    (!body.contains("VarStore::new")).then(|| {
        "--compare runs the original and the rewritten loop one after the other, each from \
         fresh weights; this cell does not create its VarStore (nn::VarStore::new), so the \
         second run would start from what the first one trained. Put the model's construction \
         in the cell, or leave out --compare."
            .to_string()
    })
}

impl<R: Runner> Cells<R> {
    /// Runs one version of the loop for `steps` steps and returns its measurements, or the
    /// outcome that ends the comparison (a refusal, an interrupt, a crash).
    fn compare_side(
        &mut self,
        name: &str,
        code: &str,
        steps: u32,
        origin: CodeOrigin,
        io: &CellIo,
    ) -> Result<Side, Box<CellOutcome>> {
        let instrumented = rewrite::instrument_for_compare(code)
            .map_err(|refusal| Box::new(fail(origin.refused(refusal))))?;
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
        // An interrupt or a crash ends the comparison: the user asked to stop, or the process
        // that ran cells is gone.
        if let Some(error) = &outcome.error {
            if error.stops_the_run() {
                return Err(Box::new(outcome));
            }
        }
        Ok(measured(outcome))
    }

    /// Runs a `%%optimize` cell.
    pub(super) fn optimize(
        &mut self,
        request: &OptimizeRequest,
        source: &CellMagicSource<'_>,
        io: CellIo,
    ) -> CellOutcome {
        self.last_training_cell = Some(source.body.to_string());
        if let Some(target) = request.fit {
            return self.optimize_fit(target, request, source, io);
        }
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
        if let Some(why) = compare_misleads(source.body) {
            return fail(CellError::new(ErrorName::RewriteRefused, why));
        }
        let mut run = |name, code, origin| self.compare_side(name, code, steps, origin, &io);
        let cell = CodeOrigin::Cell {
            body_offset: source.body_offset,
        };
        let original_side = match run("original", source.body, cell) {
            Ok(side) => side,
            Err(stop) => return *stop,
        };
        let rewritten_side = match run("rewritten", &rewritten.code, CodeOrigin::Rewritten) {
            Ok(side) => side,
            Err(stop) => return *stop,
        };
        (io.output)(CellOutput::Display(comparison_display(
            &flags,
            &original_side,
            &rewritten_side,
        )));
        match (&original_side, &rewritten_side) {
            // Both ran out of memory: that is the comparison's answer, and the display says it.
            (Err(original), Err(rewritten))
                if original.is_out_of_memory() && rewritten.is_out_of_memory() =>
            {
                CellOutcome::default()
            }
            (Err(original), Err(rewritten)) => fail(CellError::new(
                ErrorName::CompareFailed,
                format!(
                    "neither version ran: the original failed with {original}; the rewritten \
                     one with {rewritten}"
                ),
            )),
            _ => CellOutcome::default(),
        }
    }
}

/// The measurements of one compare run, or why there are none.
fn measured(outcome: CellOutcome) -> Side {
    if let Some(error) = outcome.error {
        return Err(SideFailure::new(error.ename, first_line(&error.evalue)));
    }
    outcome
        .data
        .iter()
        .find(|(mime, _)| mime.as_str() == COMPARE_RUN_MIME)
        .and_then(|(_, json)| serde_json::from_str::<CompareRun>(json).ok())
        .filter(|run| !run.losses.is_empty())
        .ok_or_else(|| {
            SideFailure::new(
                ErrorName::NoStep,
                "no training step was recorded (the loop ran no optimizer step)",
            )
        })
}

fn first_line(text: &str) -> &str {
    text.lines().next().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::{compare_cell, compare_misleads};

    #[test]
    fn the_compare_cell_keeps_commands_on_top_and_any_tail_value_in_a_block() {
        let cell = compare_cell(":dep rand = \"0.8\"\nlet x = 1;\nx + 1", 3);
        assert!(cell.starts_with(":dep rand"), "{cell}");
        assert!(
            cell.contains("begin(3);\nlet _ = {\nlet x = 1;\nx + 1\n};"),
            "{cell}"
        );
        assert!(cell.trim_end().ends_with("tchmem::compare::finish()"));
    }

    #[test]
    fn compare_needs_the_var_store_made_in_the_cell() {
        assert!(compare_misleads("let vs = nn::VarStore::new(d);").is_none());
        assert!(
            compare_misleads("for x in xs { opt.backward_step(&loss); }")
                .unwrap()
                .contains("VarStore::new")
        );
    }
}
