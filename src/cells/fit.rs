//! The "will it fit?" magics on trials of a training cell: `%memestimate`, `%memfit`,
//! `%%optimize --fit`; and `%memfree`.

use std::sync::{Arc, Mutex};

use super::optimize::code_display;
use super::trial::{TrialError, TRIAL_STEPS};
use super::{display_sink, fail, Cells, Runner};
use crate::fit::candidates::{self, Base, Candidate};
use crate::fit::estimate::Scenario;
use crate::fit::search::{self, Limits, Probe, Verdict};
use crate::fit::trial::{Outcome, Trial};
use crate::magics::fit::{EstimateRequest, FitRequest};
use crate::magics::optimize::{FitTarget, OptimizeRequest};
use crate::magics::CellMagicSource;
use crate::report::fit::{
    estimate_display, fit_summary, fits_in, fixed_terms_display, name_of, verdict_of,
    verdict_of_fit, EstimateView, LiveTable,
};
use crate::report::format::human_bytes;
use crate::rewrite::{self, Options};
use crate::session::{
    CellError, CellIo, CellOutcome, CellOutput, ErrorName, OutputSink, StreamName,
};

/// Candidates `--fit` confirms by a trial at the cell's batch, at most.
const CONFIRMATIONS: usize = 3;

impl<R: Runner> Cells<R> {
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
                    ErrorName::RewriteRefused,
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
            format!("tchmem-estimate-{}", self.runs),
            format!("%memestimate: calibrating ({what})"),
            display_sink(&io.output),
        );
        let calibration = match self.calibrate(&cell, &request.calibrated, target, &mut table) {
            Ok(Ok(calibration)) => calibration,
            Ok(Err(why)) => {
                return fail(CellError::new(
                    ErrorName::EstimateFailed,
                    format!("{why}; nothing to calibrate on (see the table above)"),
                ))
            }
            Err(TrialError::Refused(refusal)) => {
                return fail(CellError::new(
                    ErrorName::RewriteRefused,
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
                        ErrorName::RewriteRefused,
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
            format!("tchmem-memfit-{}", self.runs),
            heading,
            display_sink(&io.output),
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
            format!("tchmem-fit-{}", self.runs),
            format!(
                "%%optimize --fit {}: calibrating, then confirming the best at {} = {batch}",
                human_bytes(budget),
                cell.binding.name
            ),
            display_sink(&io.output),
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
                ErrorName::DoesNotFit,
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
                    ErrorName::RewriteRefused,
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
        let outcome = self.run(
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
                ErrorName::MemFreeFailed,
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
