//! The "will it fit?" magics in the engine: trials of a training cell (a few optimizer steps at
//! one batch size, under chosen rewrites, measured by the `--compare` instrumentation), and on
//! them `%memestimate`, `%memfit`, `%%optimize --fit`; `%memfree`.

use std::sync::{Arc, Mutex};

use serde_json::json;
use tchmem_wire::compare::{CompareRun, COMPARE_RUN_MIME};
use tchmem_wire::estimate::{DeviceRoom, OptimizerRule, DEVICE_ROOM_MIME};
use tchmem_wire::Display;

use super::errors::CellError;
use super::optimize::{code_display, compare_cell, compare_misleads};
use super::session::Session;
use super::streams::{CellOutput, StreamName};
use super::{CellIo, CellOutcome, OutputSink};
use crate::fit::candidates::{self, Base, Candidate};
use crate::fit::diagnosis::measured_fixes;
use crate::fit::estimate::{calibration_batches, fallback_batch, Calibration, Fixed, Scenario};
use crate::fit::search::{self, Limits, Probe, Verdict};
use crate::fit::trial::{Measured, Outcome, Trial};
use crate::magics::fit::{EstimateRequest, FitRequest};
use crate::magics::optimize::{FitTarget, OptimizeRequest};
use crate::magics::CellMagicSource;
use crate::report::fit::{
    estimate_display, table_display, trial_header, trial_row, EstimateView, Table,
};
use crate::report::format::human_bytes;
use crate::rewrite::batch::{self, BatchBinding};
use crate::rewrite::{self, Options, Refusal};

/// Steps of a calibration trial (a confirmation takes one more): the first creates the
/// optimizer's state, the later ones run with it (and give a step time past the warm-up).
const TRIAL_STEPS: u32 = 3;
/// Trials one calibration may take (the quarters towards a batch that fits included).
const MAX_CALIBRATION_TRIALS: usize = 6;
/// Candidates `--fit` confirms by a trial at the cell's batch, at most.
const CONFIRMATIONS: usize = 3;

/// Why a trial did not give a result.
enum TrialError {
    /// The rewrite would not apply to the cell.
    Refused(Refusal),
    /// An interrupt or a crash: the whole magic stops.
    Stopped(Box<CellOutcome>),
}

/// A failed magic.
fn fail(error: CellError) -> CellOutcome {
    CellOutcome {
        error: Some(error),
        ..Default::default()
    }
}

/// The training cell a magic acts on, with its batch binding: the magic's own body, or the last
/// training cell that ran.
struct TrainingCell {
    code: String,
    /// Line N of `code` is line N + `offset` of the magic's cell (0 for an earlier cell).
    offset: usize,
    binding: BatchBinding,
    /// The optimizer's state rule; a cell whose optimizer is not recognised counts none (its
    /// state then lies on the calibration's line).
    rule: OptimizerRule,
}

/// A table of trials shown as they run (one display, updated in place).
struct LiveTable {
    id: String,
    heading: String,
    rows: Vec<Vec<String>>,
    numbers: Vec<serde_json::Value>,
    output: OutputSink,
}

impl LiveTable {
    fn new(id: String, heading: String, output: OutputSink) -> LiveTable {
        LiveTable {
            id,
            heading,
            rows: Vec::new(),
            numbers: Vec::new(),
            output,
        }
    }

    fn push(&mut self, trial: &Trial, verdict: &str) {
        self.rows
            .push(trial_row(self.rows.len() + 1, trial, verdict));
        let measured = trial.outcome.measured();
        let number = json!({
            "batch": trial.batch,
            "rewrites": trial.options.flags(),
            "verdict": verdict,
            "peak_allocated": measured.filter(|m| m.cuda).map(|m| m.peak_allocated),
            "peak_reserved": measured.filter(|m| m.cuda).map(|m| m.peak_reserved),
            "step_seconds": measured.map(|m| m.step_seconds),
            "losses": measured.map(|m| m.losses.clone()),
        });
        tracing::info!("trial {}: {number}", self.rows.len());
        self.numbers.push(number);
        self.show(&[]);
    }

    /// `display` in the table's place (the trials were progress; the result replaces them).
    fn replaced_by(&self, mut display: Display) -> Display {
        display.display_id = Some(self.id.clone());
        display.update = !self.rows.is_empty();
        display
    }

    fn show(&self, lines: &[String]) {
        let table = Table {
            header: trial_header(),
            rows: self.rows.clone(),
        };
        (self.output)(CellOutput::Display(table_display(
            &self.heading,
            &table,
            lines,
            json!({ "trials": self.numbers }),
            Some((&self.id, self.rows.len() > 1 || !lines.is_empty())),
        )));
    }
}

fn verdict_of(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Ran(_) => "ran".into(),
        Outcome::OutOfMemory => "out of memory".into(),
        Outcome::Failed(why) => format!("failed: {why}"),
    }
}

impl Session {
    /// The training cell `source` names: its body, or (none) the last training cell that ran.
    fn training_cell(
        &mut self,
        source: &CellMagicSource<'_>,
        magic: &str,
    ) -> Result<TrainingCell, CellError> {
        let (code, offset) = if source.body.trim().is_empty() {
            match &self.last_training_cell {
                Some(code) => (code.clone(), 0),
                None => {
                    return Err(CellError::new(
                        "NoTrainingCell",
                        format!(
                            "{magic} acts on a training cell: put it on the first line of the \
                             cell with the loop, or run the training cell first"
                        ),
                    ))
                }
            }
        } else {
            (source.body.to_string(), source.body_offset)
        };
        let refused = |refusal: Refusal| {
            CellError::new(
                "RewriteRefused",
                format!(
                    "{magic} cannot vary this cell's batch: {}",
                    refusal.shifted(offset)
                ),
            )
        };
        let binding = batch::find(&code).map_err(refused)?;
        if let Some(why) = compare_misleads(&code) {
            return Err(CellError::new(
                "RewriteRefused",
                format!("{magic} runs the cell in trials: {why}"),
            ));
        }
        let rule = rewrite::training_facts(&code)
            .optimizer
            .map_or(OptimizerRule::Sgd { momentum: false }, |(_, rule)| rule);
        self.last_training_cell = Some(code.clone());
        Ok(TrainingCell {
            code,
            offset,
            binding,
            rule,
        })
    }

    /// Runs `cell` at `batch` under `options` for `steps` steps, quietly (its own output is
    /// dropped: the magic's table says what happened).
    fn trial(
        &mut self,
        cell: &TrainingCell,
        options: &Options,
        batch: u64,
        steps: u32,
    ) -> Result<Trial, TrialError> {
        let sized = batch::replace(&cell.code, &cell.binding, batch);
        // The rewrite also marks the step's phases (for the estimator's phase peaks), so the
        // loop as written goes through it too; if it will not mark them, the loop runs as is.
        let code = match rewrite::rewrite(&sized, options) {
            Ok(rewritten) => rewritten.code,
            Err(_) if options.is_empty() => sized,
            Err(refusal) => return Err(TrialError::Refused(refusal.shifted(cell.offset))),
        };
        let instrumented = rewrite::instrument_for_compare(&code)
            .map_err(|refusal| TrialError::Refused(refusal.shifted(cell.offset)))?;
        let outcome = self.run_cell_code(&compare_cell(&instrumented, steps), CellIo::quiet());
        let result = match &outcome.error {
            Some(error)
                if matches!(error.ename.as_str(), "Interrupted" | "ChildProcessCrashed") =>
            {
                return Err(TrialError::Stopped(Box::new(outcome)))
            }
            Some(error) if error.ename == "OutOfMemory" => Outcome::OutOfMemory,
            Some(error) => Outcome::Failed(format!(
                "{}: {}",
                error.ename,
                error.evalue.lines().next().unwrap_or_default()
            )),
            None => outcome
                .data
                .get(COMPARE_RUN_MIME)
                .and_then(|json| serde_json::from_str::<CompareRun>(json).ok())
                .and_then(|run| Measured::of(&run))
                .map_or_else(
                    || Outcome::Failed("no training step was recorded".into()),
                    Outcome::Ran,
                ),
        };
        Ok(Trial {
            options: options.clone(),
            batch,
            outcome: result,
        })
    }

    /// The device's room now (`None` without CUDA).
    fn device_room(&mut self) -> Option<DeviceRoom> {
        let outcome = self.run_code("tchmem::estimate::room()", CellIo::quiet());
        let json = outcome.data.get(DEVICE_ROOM_MIME)?;
        serde_json::from_str::<Option<DeviceRoom>>(json)
            .ok()
            .flatten()
    }

    /// Calibration trials of `options` for `target`, shown in `table`; `Ok(None)` when one did
    /// not run (its verdict is in the table).
    fn calibrate(
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
                Outcome::Ran(measured) => points.push((b, measured)),
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
            rule: cell.rule,
        }))
    }

    /// `%memestimate`.
    pub(super) fn memestimate(
        &mut self,
        request: &EstimateRequest,
        source: &CellMagicSource<'_>,
        io: CellIo,
    ) -> CellOutcome {
        let cell = match self.training_cell(source, "%memestimate") {
            Ok(cell) => cell,
            Err(error) => return fail(error),
        };
        let target = request.batch.unwrap_or(cell.binding.value);
        let accumulate = request.accumulate.unwrap_or(1) as u64;
        let rule = request.optimizer.map_or(cell.rule, |choice| choice.rule());
        let mut what = vec![format!("{} = {target}", cell.binding.name)];
        let flags = Options {
            accumulate: request.accumulate,
            optimizer: request.optimizer,
            ..request.calibrated.clone()
        }
        .flags();
        if !flags.is_empty() {
            what.push(flags);
        }
        what.push(rule.label().to_string());
        let what = what.join(", ");
        // Refuse before any trial runs if the rewrites do not apply.
        let full = Options {
            accumulate: request.accumulate,
            optimizer: request.optimizer,
            ..request.calibrated.clone()
        };
        if !full.is_empty() {
            if let Err(refusal) = rewrite::rewrite(&cell.code, &full) {
                return fail(CellError::new(
                    "RewriteRefused",
                    format!(
                        "%memestimate {} does not apply to this cell: {}",
                        full.flags(),
                        refusal.shifted(cell.offset)
                    ),
                ));
            }
        }
        let room = self.device_room();
        let mut table = LiveTable::new(
            format!("tchmem-estimate-{}", self.runs()),
            format!("%memestimate: calibrating ({what})"),
            Arc::clone(&io.output),
        );
        let calibration = match self.calibrate(&cell, &request.calibrated, target, &mut table) {
            Ok(Ok(calibration)) => calibration,
            Ok(Err(why)) => {
                return fail(CellError::new(
                    "EstimateFailed",
                    format!("{why}; nothing to calibrate on (see the table above)"),
                ))
            }
            Err(TrialError::Refused(refusal)) => {
                return fail(CellError::new(
                    "RewriteRefused",
                    format!(
                        "%memestimate could not apply {}: {refusal}",
                        request.calibrated.flags()
                    ),
                ))
            }
            Err(TrialError::Stopped(outcome)) => return *outcome,
        };
        let Some((_, largest)) = calibration.points.last() else {
            return CellOutcome::default();
        };
        if !largest.cuda {
            // No allocator counters: only the fixed terms are known.
            let fixed = calibration.fixed(&rule).unwrap_or_default();
            (io.output)(CellOutput::Display(
                table.replaced_by(fixed_terms_display(&what, &fixed)),
            ));
            return CellOutcome::default();
        }
        let scenario = Scenario {
            batch: target,
            accumulate,
            rule,
            begin: largest.begin,
        };
        let Some(prediction) = calibration.predict(&scenario) else {
            return CellOutcome::default();
        };
        let context = room.and_then(|r| r.context).unwrap_or(0);
        let capacity = room.map_or(0, |r| r.allocator_limit()) + context;
        let trials: Vec<Trial> = calibration
            .points
            .iter()
            .map(|(b, m)| Trial {
                options: request.calibrated.clone(),
                batch: *b,
                outcome: Outcome::Ran(m.clone()),
            })
            .collect();
        let check = if request.check {
            let options = full;
            match self.trial(&cell, &options, target, TRIAL_STEPS) {
                Ok(trial) => {
                    table.push(&trial, &format!("check: {}", verdict_of(&trial.outcome)));
                    Some(trial)
                }
                Err(TrialError::Stopped(outcome)) => return *outcome,
                Err(TrialError::Refused(refusal)) => {
                    return fail(CellError::new(
                        "RewriteRefused",
                        format!("--check could not apply {}: {refusal}", options.flags()),
                    ))
                }
            }
        } else {
            None
        };
        let estimate = estimate_display(&EstimateView {
            what,
            prediction: &prediction,
            context,
            capacity,
            trials: &trials,
            check: check.as_ref(),
        });
        (io.output)(CellOutput::Display(table.replaced_by(estimate)));
        CellOutcome::default()
    }

    /// `%memfit`.
    pub(super) fn memfit(
        &mut self,
        args: &FitRequest,
        source: &CellMagicSource<'_>,
        io: CellIo,
    ) -> CellOutcome {
        let cell = match self.training_cell(source, "%memfit") {
            Ok(cell) => cell,
            Err(error) => return fail(error),
        };
        let Some(room) = self.device_room() else {
            (io.output)(CellOutput::Stream(
                StreamName::Stdout,
                "%memfit: no CUDA device here, so no allocator limit to search against; \
                 nothing was run (on CPU the batch is bounded by the machine's memory)\n"
                    .into(),
            ));
            return CellOutcome::default();
        };
        let limits = Limits {
            capacity: room.allocator_limit(),
            margin: args.margin,
            max_trials: args.max_trials,
        };
        let heading = format!(
            "%memfit: the largest `{}` that fits in {} with a {:.0}% margin (≤ {} reserved)",
            cell.binding.name,
            human_bytes(limits.capacity),
            args.margin * 100.0,
            human_bytes(limits.allowed())
        );
        let table = Mutex::new(LiveTable::new(
            format!("tchmem-memfit-{}", self.runs()),
            heading,
            Arc::clone(&io.output),
        ));
        let mut stopped = None;
        let allowed = limits.allowed();
        let found = search::search(cell.binding.value, limits, |b, _| {
            let trial = match self.trial(&cell, &Options::default(), b, args.steps) {
                Ok(trial) => trial,
                Err(TrialError::Stopped(outcome)) => {
                    stopped = Some(outcome);
                    return None;
                }
                Err(TrialError::Refused(_)) => return None,
            };
            let probe = match &trial.outcome {
                Outcome::Ran(m) => Probe::Ran {
                    peak_reserved: m.peak_reserved,
                },
                Outcome::OutOfMemory => Probe::OutOfMemory,
                Outcome::Failed(_) => {
                    table
                        .lock()
                        .unwrap()
                        .push(&trial, &verdict_of(&trial.outcome));
                    return None;
                }
            };
            let verdict = match &probe {
                Probe::Ran { peak_reserved } if *peak_reserved <= allowed => "fits",
                Probe::Ran { .. } => "over the margin",
                Probe::OutOfMemory => "out of memory",
            };
            table
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(&trial, verdict);
            Some(probe)
        });
        if let Some(outcome) = stopped {
            return *outcome;
        }
        let table = table.into_inner().unwrap();
        let mut lines = Vec::new();
        match found.batch {
            Some(best) => {
                let peak = found
                    .trials
                    .iter()
                    .find(|t| t.0 == best && t.1 == Verdict::Fits)
                    .and_then(|t| t.2)
                    .unwrap_or(0);
                lines.push(format!(
                    "Largest batch that fits: {best} ({} reserved at its peak, of {} allowed), \
                     in {} trials{}.",
                    human_bytes(peak),
                    human_bytes(allowed),
                    found.trials.len(),
                    match found.too_big {
                        Some(big) => format!("; {big} does not fit"),
                        None => String::new(),
                    }
                ));
                lines.push(format!("Use it:  let {} = {best};", cell.binding.name));
            }
            None => lines.push(format!(
                "No batch fits, down to {}: the fixed terms (parameters, gradients, optimizer \
                 state) alone may not; try %%optimize --fit device.",
                found.trials.last().map_or(1, |t| t.0)
            )),
        }
        let wanted = cell.binding.value;
        if args.keep_effective_batch {
            match found.batch {
                Some(best) if best < wanted => {
                    let k = wanted.div_ceil(best);
                    let options = Options {
                        accumulate: Some(k as u32),
                        ..Options::default()
                    };
                    match self.trial(&cell, &options, wanted, args.steps) {
                        Ok(trial) => {
                            let fits = trial
                                .outcome
                                .measured()
                                .is_some_and(|m| m.peak_reserved <= allowed);
                            lines.push(format!(
                                "Keeping the effective batch of {wanted}: {k} micro-batches of \
                                 ≤ {best} {}. Use it:  %%optimize --accumulate {k}",
                                if fits {
                                    "fit (confirmed by the last trial)"
                                } else {
                                    "did not fit in the confirming trial (the accumulated \
                                     gradients need room too); try more"
                                }
                            ));
                            let mut table = table;
                            table.push(&trial, if fits { "fits" } else { "does not fit" });
                            table.show(&lines);
                            return CellOutcome::default();
                        }
                        Err(TrialError::Stopped(outcome)) => return *outcome,
                        Err(TrialError::Refused(refusal)) => lines.push(format!(
                            "--keep-effective-batch: %%optimize --accumulate {k} does not apply \
                             to this cell: {refusal}"
                        )),
                    }
                }
                Some(_) => lines.push(format!(
                    "The cell's batch of {wanted} fits as it is: no micro-batches needed."
                )),
                None => {}
            }
        }
        table.show(&lines);
        CellOutcome::default()
    }

    /// `%%optimize --fit`.
    pub(super) fn optimize_fit(
        &mut self,
        target: FitTarget,
        request: &OptimizeRequest,
        source: &CellMagicSource<'_>,
        io: CellIo,
    ) -> CellOutcome {
        let cell = match self.training_cell(source, "%%optimize --fit") {
            Ok(cell) => cell,
            Err(error) => return fail(error),
        };
        let room = self.device_room();
        let context = room.and_then(|r| r.context).unwrap_or(0);
        let budget = match (target, room) {
            (FitTarget::Bytes(bytes), _) => bytes,
            (FitTarget::Device, Some(room)) => room.allocator_limit() + context,
            (FitTarget::Device, None) => 0,
        };
        if room.is_none() {
            (io.output)(CellOutput::Stream(
                StreamName::Stdout,
                "%%optimize --fit: no CUDA device here, so there is no memory to fit; the loop \
                 runs as written\n"
                    .into(),
            ));
            return self.run_cell_code(&cell.code, io);
        }
        let batch = cell.binding.value;
        let mut table = LiveTable::new(
            format!("tchmem-fit-{}", self.runs()),
            format!(
                "%%optimize --fit {}: calibrating, then confirming the best at {} = {batch}",
                human_bytes(budget),
                cell.binding.name
            ),
            Arc::clone(&io.output),
        );
        let mut notes = Vec::new();
        let mut calibrations = Vec::new();
        for base in Base::ALL {
            match self.calibrate(&cell, &base.options(), batch, &mut table) {
                Ok(Ok(calibration)) => calibrations.push((base, calibration)),
                Ok(Err(why)) => notes.push(format!("{}: {why}", name_of(&base.options()))),
                Err(TrialError::Refused(refusal)) => notes.push(format!(
                    "{}: not applicable ({refusal})",
                    base.options().flags()
                )),
                Err(TrialError::Stopped(outcome)) => return *outcome,
            }
        }
        let rule = cell.rule;
        let begin = calibrations
            .first()
            .and_then(|(_, c)| c.points.first())
            .map_or(0, |(_, m)| m.begin);
        let ranked = candidates::ranked(&calibrations, &rule, batch, begin, budget, context);
        // Confirm the fastest predicted to fit, one after the other, until CONFIRMATIONS of
        // them were tried (or all).
        let mut confirmed: Vec<(Candidate, Trial)> = Vec::new();
        for candidate in diverse(&ranked, CONFIRMATIONS) {
            let trial = match self.trial(&cell, &candidate.options, batch, TRIAL_STEPS + 1) {
                Ok(trial) => trial,
                Err(TrialError::Stopped(outcome)) => return *outcome,
                Err(TrialError::Refused(refusal)) => {
                    notes.push(format!("{}: {refusal}", candidate.options.flags()));
                    continue;
                }
            };
            let fits = fits_in(&trial, budget, context);
            table.push(
                &trial,
                &format!(
                    "confirm: {}",
                    if fits {
                        "fits".to_string()
                    } else {
                        verdict_of_fit(&trial)
                    }
                ),
            );
            confirmed.push((candidate.clone(), trial));
        }
        let winner = confirmed
            .iter()
            .filter(|(_, trial)| fits_in(trial, budget, context))
            .min_by(|a, b| {
                let time = |t: &Trial| t.outcome.measured().map_or(f64::MAX, |m| m.step_seconds);
                time(&a.1).total_cmp(&time(&b.1))
            })
            .cloned();
        let mut lines = notes;
        lines.push(format!(
            "{} combinations predicted; {} predicted to fit in {}.",
            ranked.len(),
            ranked.iter().filter(|c| c.fits).count(),
            human_bytes(budget)
        ));
        let summary = fit_summary(&confirmed, budget, context);
        (io.output)(CellOutput::Display(summary));
        let Some((winner, _)) = winner else {
            let closest = ranked
                .iter()
                .min_by_key(|c| c.prediction.peak_reserved)
                .map(|c| {
                    format!(
                        " The smallest predicted peak: {} with {}.",
                        name_of(&c.options),
                        human_bytes(c.prediction.peak_reserved + context)
                    )
                })
                .unwrap_or_default();
            table.show(&lines);
            return fail(CellError::new(
                "DoesNotFit",
                format!(
                    "no combination tried fits in {} at {} = {batch}.{closest} Try a smaller \
                     batch (%memfit finds the largest) or a larger SIZE.",
                    human_bytes(budget),
                    cell.binding.name
                ),
            ));
        };
        lines.push(format!(
            "The fastest that fits: {} (run below{}).",
            name_of(&winner.options),
            if request.show {
                "; --show: not run"
            } else {
                ""
            }
        ));
        table.show(&lines);
        if winner.options.is_empty() {
            (io.output)(CellOutput::Stream(
                StreamName::Stdout,
                "The loop fits as written.\n".into(),
            ));
            return if request.show {
                CellOutcome::default()
            } else {
                self.run_cell_code(&cell.code, io)
            };
        }
        let rewritten = match rewrite::rewrite(&cell.code, &winner.options) {
            Ok(rewritten) => rewritten,
            Err(refusal) => {
                return fail(CellError::new(
                    "RewriteRefused",
                    format!("{}: {refusal}", winner.options.flags()),
                ))
            }
        };
        (io.output)(CellOutput::Display(code_display(
            &winner.options.flags(),
            &rewritten.code,
            &rewritten.changes,
        )));
        if request.show {
            return CellOutcome::default();
        }
        self.run_cell_code(&rewritten.code, io)
    }

    /// After a CUDA OOM in a training cell: two calibration trials at smaller batches and the
    /// fixes they predict, as text for the error (`None` when the cell cannot be tried: no batch
    /// binding, no VarStore of its own, no CUDA, or the trials did not run).
    pub(super) fn measured_oom_fixes(&mut self, code: &str, output: &OutputSink) -> Option<String> {
        let source = CellMagicSource {
            line: "",
            body: code,
            body_offset: 0,
        };
        let cell = self.training_cell(&source, "the OOM diagnosis").ok()?;
        let limit = self.device_room()?.allocator_limit();
        let mut table = LiveTable::new(
            format!("tchmem-oom-{}", self.runs()),
            "The OOM, measured: short trials of the cell at smaller batches".into(),
            Arc::clone(output),
        );
        let calibration =
            match self.calibrate(&cell, &Options::default(), cell.binding.value, &mut table) {
                Ok(Ok(calibration)) => calibration,
                _ => return None,
            };
        let batches: Vec<String> = calibration
            .points
            .iter()
            .map(|(b, _)| b.to_string())
            .collect();
        let begin = calibration.points.last()?.1.begin;
        let rule = cell.rule;
        let (needed, fixes) = measured_fixes(&calibration, &cell.binding, rule, begin, limit);
        let mut text = format!(
            "\nMeasured (trials at {} = {}, the table above): at {} the loop needs about {} \
             reserved; the allocator may take {}.",
            cell.binding.name,
            batches.join(" and "),
            cell.binding.value,
            human_bytes(needed),
            human_bytes(limit)
        );
        for (i, fix) in fixes.iter().enumerate() {
            text.push_str(&format!(
                "\n  {}. {:<36} {}{}",
                i + 1,
                fix.line,
                fix.why,
                if fix.covers { "" } else { ": does not fit" }
            ));
        }
        Some(text)
    }

    /// `%memfree`: empties the allocator's cache; what it gave back.
    pub(super) fn memfree(&mut self) -> Result<String, CellError> {
        let said = Arc::new(Mutex::new(String::new()));
        let sink = Arc::clone(&said);
        let capture: OutputSink = Arc::new(move |output| {
            if let CellOutput::Stream(_, text) = output {
                sink.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push_str(&text);
            }
        });
        let outcome = self.run_code(
            "match tchmem::cuda_stats::free_cache() {\n\
             Ok(f) => println!(\"tchmem-freed {} {} {}\", f.reserved_before, f.reserved_after, \
             f.allocated),\n\
             Err(e) => println!(\"tchmem-freed-error {e}\"),\n}",
            CellIo {
                output: capture,
                input: None,
            },
        );
        if let Some(error) = outcome.error {
            return Err(error);
        }
        let text = said.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(why) = text.trim().strip_prefix("tchmem-freed-error ") {
            return Ok(format!("%memfree: nothing to free ({why})"));
        }
        let numbers: Vec<u64> = text
            .trim()
            .strip_prefix("tchmem-freed ")
            .unwrap_or_default()
            .split(' ')
            .filter_map(|n| n.parse().ok())
            .collect();
        let [before, after, allocated] = numbers[..] else {
            return Err(CellError::new(
                "MemFreeFailed",
                format!("%memfree: unexpected answer from the runtime: {text}"),
            ));
        };
        Ok(format!(
            "%memfree: gave {} of cache back to the device (reserved {} → {}; {} in live \
             tensors)",
            human_bytes(before.saturating_sub(after)),
            human_bytes(before),
            human_bytes(after),
            human_bytes(allocated)
        ))
    }
}

/// The `n` fastest candidates predicted to fit, preferring ones that differ in more than the
/// optimizer (the estimator predicts the same step time whatever the optimizer, so trials of
/// several optimizers on one base tell less than trials of several bases).
fn diverse(ranked: &[Candidate], n: usize) -> Vec<&Candidate> {
    let fitting: Vec<&Candidate> = ranked.iter().filter(|c| c.fits).collect();
    let shape = |c: &Candidate| Options {
        optimizer: None,
        ..c.options.clone()
    };
    let mut chosen: Vec<&Candidate> = Vec::new();
    for candidate in &fitting {
        if chosen.len() < n && !chosen.iter().any(|c| shape(c) == shape(candidate)) {
            chosen.push(candidate);
        }
    }
    for candidate in &fitting {
        if chosen.len() < n && !chosen.iter().any(|c| std::ptr::eq(*c, *candidate)) {
            chosen.push(candidate);
        }
    }
    chosen
}

/// A configuration's name for people: its flags, or "as written".
fn name_of(options: &Options) -> String {
    match options.flags() {
        flags if flags.is_empty() => "the loop as written".into(),
        flags => flags,
    }
}

/// Whether a trial ran within `budget` (its peak reserved plus the context).
fn fits_in(trial: &Trial, budget: u64, context: u64) -> bool {
    trial
        .outcome
        .measured()
        .is_some_and(|m| m.peak_reserved + context <= budget)
}

fn verdict_of_fit(trial: &Trial) -> String {
    match &trial.outcome {
        Outcome::Ran(_) => "over the budget".into(),
        other => verdict_of(other),
    }
}

/// `--fit`'s result table: each confirmed candidate's predicted and measured peak and step time,
/// and its losses against the first confirmed candidate that keeps the loop's arithmetic
/// (no mixed precision, the same optimizer).
fn fit_summary(confirmed: &[(Candidate, Trial)], budget: u64, context: u64) -> Display {
    let reference = confirmed
        .iter()
        .find(|(c, t)| {
            c.options.amp.is_none()
                && c.options.optimizer.is_none()
                && t.outcome.measured().is_some()
        })
        .and_then(|(c, t)| Some((name_of(&c.options), t.outcome.measured()?.losses.clone())));
    let mut rows = Vec::new();
    let mut numbers = Vec::new();
    for (candidate, trial) in confirmed {
        let measured = trial.outcome.measured();
        let agreement = match (&reference, measured) {
            (Some((_, losses)), Some(m)) => losses
                .iter()
                .zip(&m.losses)
                .map(|(a, b)| (a - b).abs() / a.abs().max(1e-12))
                // A NaN (a diverged loss) must show, not vanish in the maximum.
                .fold(0.0f64, |m, d| {
                    if m.is_nan() || d.is_nan() {
                        f64::NAN
                    } else {
                        m.max(d)
                    }
                }),
            _ => f64::NAN,
        };
        rows.push(vec![
            name_of(&candidate.options),
            human_bytes(candidate.prediction.peak_reserved + context),
            measured.map_or_else(
                || verdict_of(&trial.outcome),
                |m| human_bytes(m.peak_reserved + context),
            ),
            format!("{:.1} ms", candidate.prediction.step_seconds * 1e3),
            measured.map_or("—".into(), |m| format!("{:.1} ms", m.step_seconds * 1e3)),
            if reference.is_none() || measured.is_none() {
                "—".into()
            } else if agreement.is_nan() {
                "diverged (NaN)".into()
            } else {
                format!("{:.2}%", agreement * 100.0)
            },
            if fits_in(trial, budget, context) {
                "yes"
            } else {
                "no"
            }
            .into(),
        ]);
        numbers.push(json!({
            "rewrites": candidate.options.flags(),
            "predicted_peak_reserved": candidate.prediction.peak_reserved,
            "predicted_peak_allocated": candidate.prediction.peak_allocated,
            "measured_peak_reserved": measured.map(|m| m.peak_reserved),
            "measured_peak_allocated": measured.map(|m| m.peak_allocated),
            "predicted_step_seconds": candidate.prediction.step_seconds,
            "measured_step_seconds": measured.map(|m| m.step_seconds),
            "context": context,
            "fits": fits_in(trial, budget, context),
        }));
    }
    let table = Table {
        header: [
            "rewrites",
            "predicted peak",
            "measured peak",
            "predicted step",
            "measured step",
            "max loss difference",
            "fits",
        ]
        .map(String::from)
        .to_vec(),
        rows,
    };
    let mut lines = vec![format!(
        "Peaks count the allocator's reserved bytes plus {} of CUDA context; the budget is {}.",
        human_bytes(context),
        human_bytes(budget)
    )];
    if let Some((name, _)) = &reference {
        lines.push(format!("Loss differences are relative, against {name}."));
    }
    table_display(
        "%%optimize --fit: the candidates confirmed at the cell's batch",
        &table,
        &lines,
        json!({ "confirmed": numbers, "budget": budget }),
        None,
    )
}

/// On CPU: the fixed terms only, exact.
fn fixed_terms_display(what: &str, fixed: &Fixed) -> Display {
    let text = format!(
        "Estimate, {what}: on CPU only the fixed terms are known (activations are calibrated on \
         the CUDA allocator's counters):\n  parameters       {}\n  gradients        {}\n  \
         optimizer state  {}\n  total            {}",
        human_bytes(fixed.parameters),
        human_bytes(fixed.gradients),
        human_bytes(fixed.optimizer_state),
        human_bytes(fixed.total())
    );
    let mut display = crate::report::text_display(text);
    display.data.insert(
        crate::report::fit::ESTIMATE_MIME.into(),
        json!({
            "what": what,
            "parameters": fixed.parameters,
            "gradients": fixed.gradients,
            "optimizer_state": fixed.optimizer_state,
        }),
    );
    display
}
