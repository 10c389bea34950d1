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
use crate::rewrite::earlier::{Assembled, Wanted};
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
enum CodeOrigin<'a> {
    /// The cell's own body, starting this many lines below the magic line, with what it takes
    /// from earlier cells in front of it.
    Cell {
        body_offset: usize,
        assembled: &'a Assembled,
    },
    /// The rewritten code shown above (its own line numbers).
    Rewritten,
}

impl CodeOrigin<'_> {
    fn refused(self, refusal: Refusal) -> CellError {
        match self {
            CodeOrigin::Cell {
                body_offset,
                assembled,
            } => refused(assembled.in_cell_terms(refusal), body_offset),
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

/// Starts a `--compare` run.
pub(super) const BEGIN: &str = "tchmem::compare::begin";
/// Starts a trial whose last step's operators are recorded (CUDA), for the estimate.
pub(super) const BEGIN_RECORDING_OPS: &str = "tchmem::compare::begin_recording_ops";

/// The cell that runs one instrumented version for `steps` steps, in a block so that it leaves
/// no variables behind (whatever its last expression's type), and returns the measurements as
/// its value. evcxr's `:` commands stay at the top of the cell, where evcxr reads them. The
/// VarStores in `keep` (made by earlier cells) are kept before the run and put back after it,
/// however it ends (see the runtime's `tchmem::keep`). `begin` is the runtime function that
/// starts the run ([`BEGIN`], or [`BEGIN_RECORDING_OPS`] for an estimate's trial).
pub(super) fn compare_cell(instrumented: &str, steps: u32, keep: &[String], begin: &str) -> String {
    let (commands, code): (Vec<&str>, Vec<&str>) = instrumented
        .lines()
        .partition(|line| line.trim_start().starts_with(':'));
    let (commands, code) = (commands.join("\n"), code.join("\n"));
    if keep.is_empty() {
        return format!(
            "{commands}\n{begin}({steps});\nlet _ = {{\n{code}\n}};\n\
             tchmem::compare::finish()\n"
        );
    }
    let kept: Vec<String> = keep.iter().map(|store| format!("&{store}")).collect();
    let kept = kept.join(", ");
    // The kept copy lives in the block, so it is dropped (and the stores put back) when it
    // ends; one copy of them all, so that no store's gradients go back while another's run
    // gradients still hold the run's segments. The block's value is bound and then the cell's
    // value: a block as the cell's last expression is shown with `Debug` by evcxr when the cell
    // has a `?`.
    format!(
        "{commands}\nlet __tchmem_finished = {{\nlet __tchmem_kept = tchmem::keep::keep_all(&[{kept}]);\n\
         {begin}({steps});\nlet _ = {{\n{code}\n}};\ntchmem::compare::finish()\n\
         }};\n__tchmem_finished\n"
    )
}

/// Why `--compare` and trials would mislead on this cell, if they would: every run must start
/// from the same weights, so the VarStore must be made in the cell, or be one an earlier cell
/// made that the runs keep and put back (`kept`).
pub(super) fn compare_misleads(body: &str, kept: &[String]) -> Option<String> {
    (!body.contains("VarStore::new") && kept.is_empty()).then(|| {
        "--compare and trials run the loop several times, each from the same weights; this \
         cell does not create its VarStore (nn::VarStore::new), and it uses none that an \
         earlier cell made (`let vs = nn::VarStore::new(..)` at the top of a cell), so the \
         runs would start from what the one before trained. Use the model through a variable \
         of an earlier cell, put its construction in the cell, or leave out --compare."
            .to_string()
    })
}

impl<R: Runner> Cells<R> {
    /// Runs one version of the loop for `steps` steps and returns its measurements, or the
    /// outcome that ends the comparison (a refusal, an interrupt, a crash).
    ///
    /// Under cuDNN's benchmark mode a side's first step at a shape the process has not run
    /// (bf16's, a checkpointed recompute's) times cuDNN's algorithms, with workspaces that
    /// follow what is free: the side runs again, on the algorithms cuDNN chose, as a trial
    /// does (`Cells::trial`), and its first run's peak reserved is kept beside the second's.
    fn compare_side(
        &mut self,
        name: &str,
        code: &str,
        steps: u32,
        origin: CodeOrigin<'_>,
        keep: &[String],
        io: &CellIo,
    ) -> Result<Side, Box<CellOutcome>> {
        let instrumented = rewrite::instrument_for_compare(code)
            .map_err(|refusal| Box::new(fail(origin.refused(refusal))))?;
        let cell = compare_cell(&instrumented, steps, keep, BEGIN);
        let first = self.compare_run(name, &cell, steps, io)?;
        let searched = match &first {
            Ok(run) if run.cudnn_benchmark => run.peak_reserved,
            _ => return Ok(first),
        };
        let again = format!("{name}, again on cuDNN's chosen algorithms");
        let mut second = self.compare_run(&again, &cell, steps, io)?;
        if let Ok(run) = &mut second {
            run.first_run_peak_reserved = searched;
        }
        Ok(second)
    }

    /// One run of [`Self::compare_side`]: its compare `cell`, run for `steps` steps.
    fn compare_run(
        &mut self,
        name: &str,
        cell: &str,
        steps: u32,
        io: &CellIo,
    ) -> Result<Side, Box<CellOutcome>> {
        (io.output)(CellOutput::Stream(
            StreamName::Stdout,
            format!("── {name}: {steps} step(s) ──\n"),
        ));
        self.live_label = Some(format!("--compare: {name}"));
        let outcome = self.run_cell_code(
            cell,
            CellIo {
                output: Arc::clone(&io.output),
                input: None,
            },
        );
        self.live_label = None;
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
        self.last_training_cell = Some((self.runs, source.body.to_string()));
        if let Some(target) = request.fit {
            return self.optimize_fit(target, request, source, io);
        }
        // A comparison steps a fresh optimizer on each side; a swap needs the optimizer in the
        // code: either way one built in an earlier cell is rebuilt from it.
        let assembled = self.assemble(
            source.body,
            Wanted {
                batch: false,
                optimizer: request.compare.is_some()
                    || request.options.optimizer.is_some()
                    || request.options.step_in_backward,
                model: request.options.checkpoint.is_some(),
                head: request.options.fused_loss.is_some()
                    && rewrite::loss_takes_model_output(source.body),
            },
        );
        let mut rewritten =
            match rewrite::rewrite(&assembled.code, &request.options, &assembled.known) {
                Ok(rewritten) => rewritten,
                Err(refusal) => {
                    return fail(refused(
                        assembled.in_cell_terms(refusal),
                        source.body_offset,
                    ))
                }
            };
        rewritten.changes = assembled.cell_changes(rewritten.changes);
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
            return self.run_as_the_cell(&rewritten.code, io);
        };
        let keep = &assembled.var_stores;
        if let Some(why) = compare_misleads(source.body, keep) {
            return fail(CellError::new(ErrorName::RewriteRefused, why));
        }
        let mut run = |name, code, origin| self.compare_side(name, code, steps, origin, keep, &io);
        let cell = CodeOrigin::Cell {
            body_offset: source.body_offset,
            assembled: &assembled,
        };
        let original_side = match run("original", &assembled.code, cell) {
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
            // Running out of memory is an answer (the table says which fits); any other
            // failure means the comparison has none.
            (Ok(_), Err(rewritten)) if !rewritten.is_out_of_memory() => fail(CellError::new(
                ErrorName::CompareFailed,
                format!(
                    "the rewritten loop failed with {rewritten} (the original ran, the table \
                     shows it): the rewrite does not suit this loop. Nothing of the notebook \
                     changed; please report the cell"
                ),
            )),
            (Err(original), Ok(_)) if !original.is_out_of_memory() => fail(CellError::new(
                ErrorName::CompareFailed,
                format!(
                    "the original loop failed with {original} (the rewritten one ran, the table \
                     shows it): run the cell as written to see why"
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
    use super::{compare_cell, compare_misleads, BEGIN};

    #[test]
    fn the_compare_cell_keeps_commands_on_top_and_any_tail_value_in_a_block() {
        let cell = compare_cell(":dep rand = \"0.8\"\nlet x = 1;\nx + 1", 3, &[], BEGIN);
        assert!(cell.starts_with(":dep rand"), "{cell}");
        assert!(
            cell.contains("begin(3);\nlet _ = {\nlet x = 1;\nx + 1\n};"),
            "{cell}"
        );
        assert!(cell.trim_end().ends_with("tchmem::compare::finish()"));
        // Stores of earlier cells are kept in a block that ends after the measurements.
        let cell = compare_cell(
            "opt.backward_step(&loss);",
            2,
            &["vs".into(), "critic".into()],
            BEGIN,
        );
        assert!(
            cell.contains(
                "let __tchmem_finished = {\nlet __tchmem_kept = \
                 tchmem::keep::keep_all(&[&vs, &critic]);\ntchmem::compare::begin(2);\nlet _ = \
                 {\nopt.backward_step(&loss);\n};\ntchmem::compare::finish()\n};\n\
                 __tchmem_finished"
            ),
            "{cell}"
        );
    }

    #[test]
    fn compare_needs_the_var_store_made_in_the_cell_or_kept() {
        let step = "for x in xs { opt.backward_step(&loss); }";
        assert!(compare_misleads("let vs = nn::VarStore::new(d);", &[]).is_none());
        assert!(compare_misleads(step, &["vs".into()]).is_none());
        assert!(compare_misleads(step, &[])
            .unwrap()
            .contains("VarStore::new"));
    }
}
