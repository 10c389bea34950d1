//! Trials of a training cell: a few optimizer steps at one batch size, under chosen rewrites,
//! measured by the `--compare` instrumentation and run quietly; calibration is a series of them.
//! `%memestimate`, `%memfit`, `%%optimize --fit` and the OOM diagnosis are built on these.

use tchmem_wire::compare::{CompareRun, COMPARE_RUN_MIME};
use tchmem_wire::estimate::{DeviceRoom, OptimizerRule, DEVICE_ROOM_MIME};

use super::optimize::{compare_cell, compare_misleads, BEGIN_RECORDING_OPS};
use super::study;
use super::{Cells, Runner};
use crate::fit::estimate::{calibration_batches, fallback_batch, Calibration};
use crate::fit::trial::{AlgorithmSearch, Measured, Outcome, Trial};
use crate::magics::CellMagicSource;
use crate::report::fit::{verdict_of, LiveTable};
use crate::rewrite::batch::{self, BatchBinding};
use crate::rewrite::earlier::{Assembled, Brought, UnknownOptimizer, Wanted};
use crate::rewrite::{self, Options, Refusal};
use crate::session::{CellError, CellIo, CellOutcome, ErrorName};

/// Steps of a calibration trial (a confirmation takes one more): the first creates the
/// optimizer's state, the later ones run with it (and give a step time past the warm-up).
pub(super) const TRIAL_STEPS: u32 = 3;
/// Trials one calibration may take (the quarters towards a batch that fits included).
const MAX_CALIBRATION_TRIALS: usize = 6;

/// Why a trial did not give a result.
pub(super) enum TrialError {
    /// The rewrite would not apply to the cell.
    Refused(Refusal),
    /// An interrupt or a crash: the whole magic stops.
    Stopped(Box<CellOutcome>),
}

/// The training cell a magic acts on, with its batch binding: the magic's own body, or the last
/// training cell that ran.
pub(super) struct TrainingCell {
    /// The cell as the user wrote it.
    pub code: String,
    /// Line N of `code` is line N + `offset` of the magic's cell (0 for an earlier cell).
    pub offset: usize,
    /// The cell with what trials take from earlier cells in front of it (the batch, a fresh
    /// optimizer); trials run this, and `binding` is found in it.
    pub assembled: Assembled,
    pub binding: BatchBinding,
    /// The optimizer's state rule; a cell whose optimizer is not recognised counts none (its
    /// state then lies on the calibration's line).
    pub rule: OptimizerRule,
    /// The optimizer the cell steps when its type is one tchmem does not know (the notebook's
    /// own, say): no rule counts its state, the trials measure it on their line.
    pub unknown_optimizer: Option<UnknownOptimizer>,
    /// The number of the cell `code` is (an earlier cell's, for a magic alone in its cell).
    pub run: usize,
}

impl TrainingCell {
    /// The code that sets the batch to `value`, and the cell it is in when that is an earlier
    /// one (`const BATCH_SIZE: i64 = 48; (in cell [2])`).
    pub fn batch_code(&self, value: u64) -> String {
        let written = self.binding.written(value);
        let brought = self
            .assembled
            .rebuilt
            .iter()
            .find(|rebuilt| rebuilt.name == self.binding.name);
        match brought {
            Some(rebuilt) => format!("{written} (in cell [{}])", rebuilt.run),
            None => written,
        }
    }
}

impl<R: Runner> Cells<R> {
    /// The training cell `source` names: its body, or (none) the last training cell that ran.
    pub(super) fn training_cell(
        &mut self,
        source: &CellMagicSource<'_>,
        magic: &str,
    ) -> Result<TrainingCell, CellError> {
        let (code, offset, run) = if source.body.trim().is_empty() {
            match &self.last_training_cell {
                Some((run, code)) => (code.clone(), 0, *run),
                None => {
                    return Err(CellError::new(
                        ErrorName::NoTrainingCell,
                        format!(
                            "{magic} acts on a training cell: put it on the first line of the \
                             cell with the loop, or run the training cell first"
                        ),
                    ))
                }
            }
        } else {
            (source.body.to_string(), source.body_offset, self.runs)
        };
        let assembled = self.assemble_as(&code, run, Wanted::TRIAL);
        let refused = |refusal: Refusal| {
            CellError::new(
                ErrorName::RewriteRefused,
                format!(
                    "{magic} cannot vary this cell's batch: {}",
                    assembled.in_cell_terms(refusal).shifted(offset)
                ),
            )
        };
        let binding = batch::find(&assembled.code).map_err(refused)?;
        if let Some(why) = compare_misleads(&code, &assembled.var_stores) {
            return Err(CellError::new(
                ErrorName::RewriteRefused,
                format!("{magic} runs the cell in trials: {why}"),
            ));
        }
        let known_rule = rewrite::training_facts(&assembled.code)
            .optimizer
            .or_else(|| assembled.known.rules_built_by_functions.first().cloned());
        let unknown_optimizer = known_rule
            .is_none()
            .then(|| assembled.known.unknown_optimizers.first().cloned())
            .flatten();
        let rule = known_rule.map_or(OptimizerRule::Sgd { momentum: false }, |(_, rule)| rule);
        self.last_training_cell = Some((self.runs, code.clone()));
        Ok(TrainingCell {
            code,
            offset,
            assembled,
            binding,
            rule,
            unknown_optimizer,
            run,
        })
    }

    /// The cell as trials under `options` run it when that differs from `cell.assembled`:
    /// checkpointing rewrites the model's builders, and the fused loss marks a head inside the
    /// model, so a model built by earlier cells is rebuilt.
    pub(super) fn with_rebuilt_model(
        &self,
        cell: &TrainingCell,
        options: &Options,
    ) -> Option<Assembled> {
        let head = options.fused_loss.is_some() && rewrite::loss_takes_model_output(&cell.code);
        if options.checkpoint.is_none() && !head {
            return None;
        }
        let assembled = self.assembled_for_rewrites(cell, options);
        assembled
            .rebuilt
            .iter()
            .any(|rebuilt| rebuilt.what == Brought::Model)
            .then_some(assembled)
    }

    /// `cell` with what its trials bring in and, where `options` rewrite the model, what the
    /// rewriter may read of the models of earlier cells: a refusal then says what the model is
    /// (a library's, a struct, one of several parts on one store) when none can be rebuilt.
    pub(super) fn assembled_for_rewrites(
        &self,
        cell: &TrainingCell,
        options: &Options,
    ) -> Assembled {
        let head = options.fused_loss.is_some() && rewrite::loss_takes_model_output(&cell.code);
        self.assemble_as(
            &cell.code,
            cell.run,
            Wanted {
                model: options.checkpoint.is_some(),
                head,
                ..Wanted::TRIAL
            },
        )
    }

    /// Runs `cell` at `batch` under `options` for `steps` steps, quietly (its own output is
    /// dropped: the magic's table says what happened).
    ///
    /// Under cuDNN's benchmark mode the first step at a shape the process has not run times
    /// cuDNN's algorithms, with workspaces that follow what is free rather than the batch (on an H100 under a 1.4 GiB limit, resnet18's trials reserved 1.3-1.4 GiB
    /// at every new batch from 260 to 512, 890 MiB at 256, which the notebook had run:
    /// `results/gpu/2026-12-06-pairing-benchmark/`). Such a trial runs again right after: cuDNN
    /// keeps its choice per shape for the process, so the second run measures steps on the
    /// algorithms it chose, from the same beginning as any trial; the first run's peaks are kept
    /// beside them. A run whose recorded operators hold no convolution (a transformer with the
    /// mode on) timed nothing and does not run again.
    pub(super) fn trial(
        &mut self,
        cell: &TrainingCell,
        options: &Options,
        batch: u64,
        steps: u32,
    ) -> Result<Trial, TrialError> {
        let (first, cudnn_benchmark) = self.run_trial(cell, options, batch, steps, false)?;
        let searched = match &first.outcome {
            Outcome::Ran(m) if cudnn_benchmark && m.may_have_timed_convolutions() => {
                AlgorithmSearch {
                    peak_allocated: m.peak_allocated,
                    peak_reserved: m.peak_reserved,
                }
            }
            _ => return Ok(first),
        };
        let (mut again, _) = self.run_trial(cell, options, batch, steps, true)?;
        if let Outcome::Ran(m) = &mut again.outcome {
            m.algorithm_search = Some(searched);
        }
        Ok(again)
    }

    /// One run of [`Self::trial`] (`again`: the second, on cuDNN's chosen algorithms); also says
    /// whether cuDNN's benchmark mode was on in it.
    fn run_trial(
        &mut self,
        cell: &TrainingCell,
        options: &Options,
        batch: u64,
        steps: u32,
        again: bool,
    ) -> Result<(Trial, bool), TrialError> {
        let with_model = self.with_rebuilt_model(cell, options);
        let assembled = with_model.as_ref().unwrap_or(&cell.assembled);
        let refused = |refusal: Refusal| {
            TrialError::Refused(assembled.in_cell_terms(refusal).shifted(cell.offset))
        };
        let binding = match &with_model {
            Some(assembled) => batch::find(&assembled.code).map_err(refused)?,
            None => cell.binding.clone(),
        };
        let sized = batch::replace(&assembled.code, &binding, batch);
        // The rewrite also marks the step's phases (for the estimator's phase peaks), so the
        // loop as written goes through it too; if it will not mark them, the loop runs as is.
        let code = match rewrite::rewrite(&sized, options, &assembled.known) {
            Ok(rewritten) => rewritten.code,
            Err(_) if options.is_empty() => sized.clone(),
            Err(refusal) => return Err(refused(refusal)),
        };
        let instrumented = rewrite::instrument_for_compare(&code).map_err(|refusal| {
            // The rewrite adds lines, which its refusal would name: asked of the code as the
            // cell has it, the lines are the cell's.
            refused(
                rewrite::instrument_for_compare(&sized)
                    .err()
                    .unwrap_or(refusal),
            )
        })?;
        let run = compare_cell(
            &instrumented,
            steps,
            &assembled.var_stores,
            BEGIN_RECORDING_OPS,
        );
        // Its own output is dropped; its live view shows under the magic's cell.
        let chosen = if again {
            ", on cuDNN's chosen algorithms"
        } else {
            ""
        };
        self.live_label = Some(format!("trial at batch {batch}{}{chosen}", options.flags()));
        let outcome = self.run_cell_code(&run, self.live_view_only());
        self.live_label = None;
        let run = outcome
            .data
            .get(COMPARE_RUN_MIME)
            .and_then(|json| serde_json::from_str::<CompareRun>(json).ok());
        let result = match &outcome.error {
            Some(error) if error.stops_the_run() => {
                return Err(TrialError::Stopped(Box::new(outcome)))
            }
            Some(error) if error.ename == ErrorName::OutOfMemory => Outcome::OutOfMemory,
            Some(error) => Outcome::Failed(format!(
                "{}: {}",
                error.ename,
                error.evalue.lines().next().unwrap_or_default()
            )),
            None => run.as_ref().and_then(Measured::of).map_or_else(
                || Outcome::Failed("no training step was recorded".into()),
                |measured| Outcome::Ran(Box::new(measured)),
            ),
        };
        let trial = Trial {
            options: options.clone(),
            batch,
            outcome: result,
        };
        if let Some(run) = &run {
            study::keep_trial(&trial, run, again);
        }
        let cudnn_benchmark = run.is_some_and(|run| run.cudnn_benchmark);
        Ok((trial, cudnn_benchmark))
    }

    /// The device's room now (`None` without CUDA).
    pub(super) fn device_room(&mut self) -> Option<DeviceRoom> {
        let outcome = self.run("tchmem::estimate::room()", CellIo::quiet());
        let json = outcome.data.get(DEVICE_ROOM_MIME)?;
        serde_json::from_str::<Option<DeviceRoom>>(json)
            .ok()
            .flatten()
    }

    /// Calibration trials of `options` for `target`, shown in `table`; `Ok(None)` when one did
    /// not run (its verdict is in the table).
    pub(super) fn calibrate(
        &mut self,
        cell: &TrainingCell,
        options: &Options,
        target: u64,
        table: &mut LiveTable,
    ) -> Result<Result<Calibration, String>, TrialError> {
        let mut points: Vec<(u64, Measured)> = Vec::new();
        let mut batches = calibration_batches(target);
        let mut tried = 0;
        while !batches.is_empty() && tried < MAX_CALIBRATION_TRIALS {
            let b = batches.remove(0);
            tried += 1;
            let trial = self.trial(cell, options, b, TRIAL_STEPS)?;
            table.push(
                &trial,
                &format!("calibration: {}", verdict_of(&trial.outcome)),
            );
            match trial.outcome {
                Outcome::Ran(measured) => points.push((b, *measured)),
                // Not even the smaller point fits: a quarter of it (far too large a batch is
                // what an OOM diagnosis starts from).
                Outcome::OutOfMemory if points.is_empty() && b > 1 => {
                    let small = (b / 4).max(1);
                    batches = vec![small, (b / 2).max(small + 1)];
                    batches.dedup();
                }
                // The larger point did not fit: calibrate below the smaller one instead.
                Outcome::OutOfMemory if !points.is_empty() => match fallback_batch(points[0].0) {
                    Some(lower) => batches.push(lower),
                    None => break,
                },
                other => {
                    return Ok(Err(format!(
                        "the calibration trial at batch {b} {}",
                        verdict_of(&other)
                    )))
                }
            }
        }
        if points.is_empty() {
            return Ok(Err(format!(
                "no calibration trial fitted in {tried} trials"
            )));
        }
        points.sort_by_key(|(b, _)| *b);
        Ok(Ok(Calibration {
            points,
            rule: options.optimizer.map_or(cell.rule, |choice| choice.rule()),
            gradients_in_backward: options.step_in_backward,
            replayed: None,
        }))
    }
}
