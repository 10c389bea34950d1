//! The "will it fit?" magics on trials of a training cell: `%memestimate`, `%memfit`,
//! `%%optimize --fit`; and `%memfree`.

use std::sync::{Arc, Mutex};

use super::trial::{TrainingCell, TrialError, TRIAL_STEPS};
use super::{display_sink, fail, Cells, Runner};
use crate::fit::estimate::Scenario;
use crate::fit::search::{self, Found, Limits, Probe, Verdict};
use crate::fit::trial::{Outcome, Trial};
use crate::magics::fit::{EstimateRequest, FitRequest};
use crate::magics::CellMagicSource;
use crate::report::fit::{
    estimate_display, fixed_terms_display, verdict_of, EstimateView, LiveTable,
};
use crate::report::format::human_bytes;
use crate::rewrite::earlier::UnknownOptimizer;
use crate::rewrite::{self, Options};
use crate::session::{
    CellError, CellIo, CellOutcome, CellOutput, ErrorName, OutputSink, StreamName,
};

impl<R: Runner> Cells<R> {
    /// `%memestimate`.
    pub(super) fn memestimate(
        &mut self,
        request: &EstimateRequest,
        source: &CellMagicSource<'_>,
        io: CellIo,
    ) -> CellOutcome {
        // Alone, after a model newer than any training cell: that model's terms.
        if source.body.trim().is_empty() {
            if let Some(model) = self.model_newer_than_training() {
                return self.estimate_model(&model, request, &io);
            }
        }
        let cell = match self.training_cell(source, "%memestimate") {
            Ok(cell) => cell,
            Err(error) => return fail(error),
        };
        let effective = request.batch.unwrap_or(cell.binding.value);
        // Data parallel: one rank's estimate, at its share of the batch.
        let ranks = request.data_parallel.map_or(1, |dp| u64::from(dp.ranks));
        if !effective.is_multiple_of(ranks) {
            return fail(CellError::new(
                ErrorName::MagicError,
                format!(
                    "%memestimate --gpus {ranks}: the batch {effective} does not split evenly \
                     over {ranks} ranks; give a --batch that {ranks} divides"
                ),
            ));
        }
        let target = effective / ranks;
        let zero_ranks = request
            .data_parallel
            .filter(|dp| dp.zero.is_some())
            .map(|dp| dp.ranks as usize);
        let accumulate = request.accumulate.unwrap_or(1) as u64;
        let rule = request.optimizer.map_or(cell.rule, |choice| choice.rule());
        // The trials run the other optimizer too: its step's time (and temporaries) are its
        // own, where its rule alone gave the state and the cell's optimizer the time (on an
        // H100, the nine Adafactor checks ran 1-80% longer than trials of the cell's optimizer
        // said, median 26%: results/gpu/2026-12-05-accumulate/).
        let calibrated = Options {
            optimizer: request.optimizer,
            ..request.calibrated.clone()
        };
        let full = Options {
            accumulate: request.accumulate,
            ..calibrated.clone()
        };
        // An optimizer of a type tchmem does not know, when the trials keep it: no rule counts
        // its state.
        let unknown = cell
            .unknown_optimizer
            .as_ref()
            .filter(|_| request.optimizer.is_none());
        let rule_words =
            unknown.map_or_else(|| rule.label().to_string(), UnknownOptimizer::heading);
        let mut what = estimate_label(&cell.binding.name, effective, &full, &rule_words);
        if let Some(dp) = request.data_parallel {
            what.push_str(&format!(", per rank of {} ({target} each)", dp.ranks));
            if let Some(stage) = dp.zero {
                what.push_str(&format!(", ZeRO stage {stage} (the most loaded rank)"));
            }
        }
        // Refuse before any trial runs if the rewrites do not apply.
        if !full.is_empty() {
            let assembled = self.assembled_for_rewrites(&cell, &full);
            if let Err(refusal) = rewrite::rewrite(&assembled.code, &full, &assembled.known) {
                return fail(CellError::new(
                    ErrorName::RewriteRefused,
                    format!(
                        "%memestimate {} does not apply to this cell: {}",
                        full.flags(),
                        assembled.in_cell_terms(refusal).shifted(cell.offset)
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
        let mut calibration = match self.calibrate(&cell, &calibrated, target, &mut table) {
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
                    format!("%memestimate {}: {refusal}", trials_refused(&calibrated)),
                ))
            }
            Err(TrialError::Stopped(outcome)) => return *outcome,
        };
        let Some((_, largest)) = calibration.points.last() else {
            return CellOutcome::default();
        };
        if !largest.cuda {
            // No allocator counters: only the fixed terms are known.
            let fixed = calibration
                .fixed_on_rank(&rule, zero_ranks)
                .unwrap_or_default();
            (io.output)(CellOutput::Display(table.replaced_by(fixed_terms_display(
                &what,
                &fixed,
                unknown.map(UnknownOptimizer::described).as_deref(),
            ))));
            return CellOutcome::default();
        }
        let scenario = Scenario {
            batch: target,
            accumulate,
            rule,
            begin: largest.begin,
            zero_ranks,
        };
        self.replay_heaviest(&mut calibration, scenario.micro_batch());
        let Some(mut prediction) = calibration.predict(&scenario) else {
            return CellOutcome::default();
        };
        if let Some(optimizer) = unknown {
            prediction.state_measured_in_line(&optimizer.described());
        }
        let context = room.and_then(|r| r.context).unwrap_or(0);
        let capacity = room.map_or(0, |r| r.allocator_limit()) + context;
        let trials: Vec<Trial> = calibration
            .points
            .iter()
            .map(|(b, m)| Trial {
                options: calibrated.clone(),
                batch: *b,
                outcome: Outcome::Ran(Box::new(m.clone())),
            })
            .collect();
        let check = if request.check {
            match self.check_trial(&cell, full, target, &mut table) {
                Ok(trial) => Some(trial),
                Err(stopped) => return *stopped,
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

    /// `%memestimate --check`: the cell run at the estimated batch under the estimated rewrites,
    /// shown in `table`; a refusal or a stop ends the magic.
    fn check_trial(
        &mut self,
        cell: &TrainingCell,
        options: Options,
        target: u64,
        table: &mut LiveTable,
    ) -> Result<Trial, Box<CellOutcome>> {
        match self.trial(cell, &options, target, TRIAL_STEPS) {
            Ok(trial) => {
                table.push(&trial, &format!("check: {}", verdict_of(&trial.outcome)));
                Ok(trial)
            }
            Err(TrialError::Stopped(outcome)) => Err(outcome),
            Err(TrialError::Refused(refusal)) => Err(Box::new(fail(CellError::new(
                ErrorName::RewriteRefused,
                format!("--check {}: {refusal}", trials_refused(&options)),
            )))),
        }
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
        let table = LiveTable::new(
            format!("tchmem-memfit-{}", self.runs),
            heading,
            display_sink(&io.output),
        );
        let allowed = limits.allowed();
        let (found, mut table) = match self.search_largest(&cell, args.steps, limits, table) {
            Ok(found) => found,
            Err(stopped) => return *stopped,
        };
        let mut lines = found_lines(&found, allowed, &cell);
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
                            table.push(&trial, if fits { "fits" } else { "does not fit" });
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

    /// The batch search of `%memfit`: trials of the cell as written, grown then narrowed
    /// within `limits`, each a row of `table`; stopped by an interrupt or a crash.
    fn search_largest(
        &mut self,
        cell: &TrainingCell,
        steps: u32,
        limits: Limits,
        table: LiveTable,
    ) -> Result<(Found, LiveTable), Box<CellOutcome>> {
        let table = Mutex::new(table);
        let mut stopped = None;
        let allowed = limits.allowed();
        let found = search::search(cell.binding.value, limits, |b, _| {
            let trial = match self.trial(cell, &Options::default(), b, steps) {
                Ok(trial) => trial,
                Err(TrialError::Stopped(outcome)) => {
                    stopped = Some(outcome);
                    return None;
                }
                Err(TrialError::Refused(_)) => return None,
            };
            let mut table = table.lock().unwrap_or_else(|e| e.into_inner());
            let probe = match &trial.outcome {
                Outcome::Ran(m) => Probe::Ran {
                    peak_reserved: m.peak_reserved,
                },
                Outcome::OutOfMemory => Probe::OutOfMemory,
                Outcome::Failed(_) => {
                    table.push(&trial, &verdict_of(&trial.outcome));
                    return None;
                }
            };
            let verdict = match &probe {
                Probe::Ran { peak_reserved } if *peak_reserved <= allowed => "fits",
                Probe::Ran { .. } => "over the margin",
                Probe::OutOfMemory => "out of memory",
            };
            table.push(&trial, verdict);
            Some(probe)
        });
        match stopped {
            Some(outcome) => Err(outcome),
            None => Ok((found, table.into_inner().unwrap_or_else(|e| e.into_inner()))),
        }
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

/// What `%memfit`'s search found, in words: the largest batch and the line to use it, or that
/// none fits.
fn found_lines(found: &Found, allowed: u64, cell: &TrainingCell) -> Vec<String> {
    let Some(best) = found.batch else {
        return vec![format!(
            "No batch fits, down to {}: the fixed terms (parameters, gradients, optimizer \
             state) alone may not; try %%optimize --fit device.",
            found.trials.last().map_or(1, |t| t.0)
        )];
    };
    let peak = found
        .trials
        .iter()
        .find(|t| t.0 == best && t.1 == Verdict::Fits)
        .and_then(|t| t.2)
        .unwrap_or(0);
    vec![
        format!(
            "Largest batch that fits: {best} ({} reserved at its peak, of {} allowed), in {} \
             trials{}.",
            human_bytes(peak),
            human_bytes(allowed),
            found.trials.len(),
            match found.too_big {
                Some(big) => format!("; {big} does not fit"),
                None => String::new(),
            }
        ),
        format!("Use it:  {}", cell.batch_code(best)),
    ]
}

/// What failed when a trial's rewrite was refused: the techniques asked for, or (none asked)
/// timing the loop step by step.
fn trials_refused(options: &Options) -> String {
    if options.is_empty() {
        "runs the cell in trials that time each training step, and cannot here".to_string()
    } else {
        format!("could not apply {}", options.flags())
    }
}

/// What an estimate is of, for its heading: the batch, the rewrites and the optimizer (its
/// rule's name, or a type tchmem does not know).
fn estimate_label(name: &str, batch: u64, options: &Options, optimizer: &str) -> String {
    let mut what = vec![format!("{name} = {batch}")];
    let flags = options.flags();
    if !flags.is_empty() {
        what.push(flags);
    }
    what.push(optimizer.to_string());
    what.join(", ")
}
