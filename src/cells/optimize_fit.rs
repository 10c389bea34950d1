//! `%%optimize --fit SIZE|device`: every base configuration calibrated, every combination with
//! accumulation and the leaner optimizers predicted and ranked, the fastest few confirmed by a
//! trial at the cell's batch, and the fastest that fits shown and run.

use super::optimize::code_display;
use super::trial::{TrainingCell, TrialError, TRIAL_STEPS};
use super::{display_sink, fail, Cells, Runner};
use crate::fit::candidates::{self, Base, Candidate, Optimizers};
use crate::fit::estimate::Calibration;
use crate::fit::trial::Trial;
use crate::magics::optimize::{FitTarget, OptimizeRequest};
use crate::magics::CellMagicSource;
use crate::report::fit::{
    fit_summary, fits_in, name_of, verdict_of_fit, verdict_of_optimizer_timing, LiveTable,
};
use crate::report::format::human_bytes;
use crate::rewrite::earlier::Wanted;
use crate::rewrite::{self, Options};
use crate::session::{CellError, CellIo, CellOutcome, CellOutput, ErrorName, StreamName};

/// Candidates `--fit` confirms by a trial at the cell's batch, at most.
const CONFIRMATIONS: usize = 3;

/// What a configuration must fit in: the allocator's share and the CUDA context beside it.
#[derive(Clone, Copy)]
struct Budget {
    bytes: u64,
    context: u64,
}

impl<R: Runner> Cells<R> {
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
            return self.run_as_the_cell(&cell.code, io);
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
        let calibrations = match self.calibrate_bases(&cell, &mut table, &mut notes) {
            Ok(calibrations) => calibrations,
            Err(stopped) => return *stopped,
        };
        let optimizers = match self.time_swaps(&cell, &calibrations, &mut table, &mut notes) {
            Ok(optimizers) => optimizers,
            Err(stopped) => return *stopped,
        };
        let begin = calibrations
            .first()
            .and_then(|(_, c)| c.points.first())
            .map_or(0, |(_, m)| m.begin);
        let ranked = candidates::ranked(&calibrations, &optimizers, batch, begin, budget, context);
        let budget = Budget {
            bytes: budget,
            context,
        };
        let confirmed = match self.confirm(&cell, &ranked, budget, &mut table, &mut notes) {
            Ok(confirmed) => confirmed,
            Err(stopped) => return *stopped,
        };
        let Budget {
            bytes: budget,
            context,
        } = budget;
        let winner = confirmed
            .iter()
            .filter(|(_, trial)| fits_in(trial, budget, context))
            .min_by(|a, b| {
                let time = |t: &Trial| t.outcome.measured().map_or(f64::MAX, |m| m.step_seconds);
                time(&a.1).total_cmp(&time(&b.1))
            })
            .cloned();
        let mut lines = notes;
        lines.push(fitting_line(&ranked, budget));
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
        self.run_winner(&cell, &winner.options, request.show, &mut table, lines, io)
    }

    /// Confirms the fastest candidates predicted to fit by a trial each at the cell's batch,
    /// one after the other, until [`CONFIRMATIONS`] of them were tried (or all); each shown in
    /// `table`.
    fn confirm(
        &mut self,
        cell: &TrainingCell,
        ranked: &[Candidate],
        budget: Budget,
        table: &mut LiveTable,
        notes: &mut Vec<String>,
    ) -> Result<Vec<(Candidate, Trial)>, Box<CellOutcome>> {
        let Budget {
            bytes: budget,
            context,
        } = budget;
        let batch = cell.binding.value;
        let mut confirmed: Vec<(Candidate, Trial)> = Vec::new();
        for candidate in diverse(ranked, CONFIRMATIONS) {
            let trial = match self.trial(cell, &candidate.options, batch, TRIAL_STEPS + 1) {
                Ok(trial) => trial,
                Err(TrialError::Stopped(outcome)) => return Err(outcome),
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
        Ok(confirmed)
    }

    /// Calibrates each base configuration (as written, checkpoint, bf16, both) at the cell's
    /// batch, and runs its heaviest operators alone there, as `%memestimate` does: on lines
    /// through two small trials alone, resnet18's peak as written came out 2.0 GiB where it ran
    /// in 1.6 (cuDNN's workspaces do not follow the batch). Right after the base's own trials:
    /// the child keeps only the last few recordings, fewer than nine bases make. The candidates
    /// that accumulate run smaller micro-batches, and keep their lines. A base that does not
    /// apply or did not run is noted instead.
    fn calibrate_bases(
        &mut self,
        cell: &TrainingCell,
        table: &mut LiveTable,
        notes: &mut Vec<String>,
    ) -> Result<Vec<(Base, Calibration)>, Box<CellOutcome>> {
        let mut calibrations = Vec::new();
        // Where the loss cannot be fused, no base with the fused loss is tried (one note says
        // why).
        let mut unfusable = false;
        for base in Base::all() {
            if unfusable && base.fused_loss {
                continue;
            }
            match self.calibrate(cell, &base.options(), cell.binding.value, table) {
                Ok(Ok(mut calibration)) => {
                    self.replay_heaviest(&mut calibration, cell.binding.value);
                    calibrations.push((base, calibration));
                }
                Ok(Err(why)) => notes.push(format!("{}: {why}", name_of(&base.options()))),
                Err(TrialError::Refused(refusal)) => {
                    let fused_alone = base.fused_loss && !base.checkpoint && !base.bf16;
                    unfusable |= fused_alone;
                    notes.push(format!(
                        "{}: not applicable ({refusal})",
                        if fused_alone {
                            "--fused-loss".to_string()
                        } else {
                            base.options().flags()
                        }
                    ))
                }
                Err(TrialError::Stopped(outcome)) => return Err(outcome),
            }
        }
        Ok(calibrations)
    }

    /// Times each leaner optimizer's step against the cell's, so that candidates that swap it
    /// in are ranked at their own time (on an H100 Adafactor's steps ran 1-80% longer than the
    /// cell's optimizer's time said): one trial of each at the first calibration's smaller batch
    /// under its rewrites, whose optimizer step is compared with that calibration trial's (an
    /// optimizer's step does not grow with the batch). A swap the rewrite refuses is left out;
    /// one that was not timed keeps the cell's time; each is noted.
    fn time_swaps(
        &mut self,
        cell: &TrainingCell,
        calibrations: &[(Base, Calibration)],
        table: &mut LiveTable,
        notes: &mut Vec<String>,
    ) -> Result<Optimizers, Box<CellOutcome>> {
        let mut optimizers = Optimizers::untimed(cell.rule);
        let first = calibrations
            .first()
            .and_then(|(base, c)| Some((base, c.points.first()?)));
        let Some((base, (batch, measured))) = first else {
            return Ok(optimizers);
        };
        let Some(own) = measured.optimizer_step_seconds else {
            notes.push(
                "The leaner optimizers are ranked at the cell's optimizer's step time: its \
                 trials did not time the optimizer's step (the loop marks none, or ends first)."
                    .into(),
            );
            return Ok(optimizers);
        };
        let mut kept = Vec::new();
        for mut swap in optimizers.swaps {
            let options = Options {
                optimizer: Some(swap.choice),
                ..base.options()
            };
            let trial = match self.trial(cell, &options, *batch, TRIAL_STEPS) {
                Ok(trial) => trial,
                Err(TrialError::Stopped(outcome)) => return Err(outcome),
                Err(TrialError::Refused(refusal)) => {
                    notes.push(format!(
                        "--optimizer {}: not applicable ({refusal})",
                        swap.choice.flag_value()
                    ));
                    continue;
                }
            };
            table.push(&trial, &verdict_of_optimizer_timing(&trial, own));
            swap.added_seconds = trial
                .outcome
                .measured()
                .and_then(|m| m.optimizer_step_seconds)
                .map(|step| step - own);
            kept.push(swap);
        }
        optimizers.swaps = kept;
        Ok(optimizers)
    }

    /// Shows the chosen configuration under the table and runs it (the rewritten loop with its
    /// code shown, or the loop as written); `--show` stops before running.
    fn run_winner(
        &mut self,
        cell: &TrainingCell,
        winner: &Options,
        show: bool,
        table: &mut LiveTable,
        mut lines: Vec<String>,
        io: CellIo,
    ) -> CellOutcome {
        lines.push(format!(
            "The fastest that fits: {} (run below{}).",
            name_of(winner),
            if show { "; --show: not run" } else { "" }
        ));
        table.show(&lines);
        if winner.is_empty() {
            (io.output)(CellOutput::Stream(
                StreamName::Stdout,
                "The loop fits as written.\n".into(),
            ));
            return if show {
                CellOutcome::default()
            } else {
                self.run_as_the_cell(&cell.code, io)
            };
        }
        // A leaner optimizer replaces the one the cell steps, wherever it was built.
        let assembled = self.assemble_as(
            &cell.code,
            cell.run,
            Wanted {
                batch: false,
                optimizer: winner.optimizer.is_some() || winner.step_in_backward,
                model: winner.checkpoint.is_some(),
                head: winner.fused_loss.is_some() && rewrite::loss_takes_model_output(&cell.code),
            },
        );
        let mut rewritten = match rewrite::rewrite(&assembled.code, winner, &assembled.known) {
            Ok(rewritten) => rewritten,
            Err(refusal) => {
                return fail(CellError::new(
                    ErrorName::RewriteRefused,
                    format!("{}: {}", winner.flags(), assembled.in_cell_terms(refusal)),
                ))
            }
        };
        rewritten.changes = assembled.cell_changes(rewritten.changes);
        (io.output)(CellOutput::Display(code_display(
            &winner.flags(),
            &rewritten.code,
            &rewritten.changes,
        )));
        if show {
            return CellOutcome::default();
        }
        self.run_as_the_cell(&rewritten.code, io)
    }
}

/// How many candidates were predicted, and how many fit (and how many of those only at the point
/// of a peak reserved range: ranked after the others).
fn fitting_line(ranked: &[Candidate], budget: u64) -> String {
    let fitting = ranked.iter().filter(|c| c.fits).count();
    let at_point_only = ranked.iter().filter(|c| c.fits && !c.fits_at_high).count();
    format!(
        "{} combinations predicted; {fitting} predicted to fit in {}{}.",
        ranked.len(),
        human_bytes(budget),
        if at_point_only > 0 {
            format!(
                " ({at_point_only} of them at the point of their peak reserved range only, not \
                 at its high end: ranked after the others)"
            )
        } else {
            String::new()
        }
    )
}

/// The `n` fastest candidates predicted to fit, preferring ones that differ in more than the
/// optimizer (a swap changes the step by its optimizer's step, timed once, so trials of
/// several optimizers on one base tell less than trials of several bases), and among those, the
/// ones that fit at the high end of their peak reserved range before those that fit at its point
/// only. A trial confirms each: a point-only candidate costs a trial at most, and may be the
/// fastest that fits.
fn diverse(ranked: &[Candidate], n: usize) -> Vec<&Candidate> {
    let shape = |c: &Candidate| Options {
        optimizer: None,
        ..c.options.clone()
    };
    let class = |sure: bool| {
        ranked
            .iter()
            .filter(move |c| c.fits && c.fits_at_high == sure)
    };
    let mut chosen: Vec<&Candidate> = Vec::new();
    for candidate in class(true).chain(class(false)) {
        if chosen.len() < n && !chosen.iter().any(|c| shape(c) == shape(candidate)) {
            chosen.push(candidate);
        }
    }
    for candidate in class(true).chain(class(false)) {
        if chosen.len() < n && !chosen.iter().any(|c| std::ptr::eq(*c, candidate)) {
            chosen.push(candidate);
        }
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fit::estimate::Prediction;
    use crate::rewrite::{Amp, OptimizerChoice};

    fn bf16() -> Options {
        Options {
            amp: Some(Amp::Bf16),
            ..Options::default()
        }
    }

    fn candidate(options: Options, fits: bool, fits_at_high: bool) -> Candidate {
        Candidate {
            options,
            prediction: Prediction::default(),
            fits,
            fits_at_high,
        }
    }

    /// The positions in `ranked` of the `n` candidates [`diverse`] chooses, in its order.
    fn chosen(ranked: &[Candidate], n: usize) -> Vec<usize> {
        diverse(ranked, n)
            .into_iter()
            .map(|c| ranked.iter().position(|r| std::ptr::eq(r, c)).unwrap())
            .collect()
    }

    #[test]
    fn confirmations_prefer_other_bases_then_sure_candidates_and_the_line_counts_the_others() {
        let half = bf16();
        let with = |optimizer| Options {
            optimizer: Some(optimizer),
            ..Options::default()
        };
        // Ranked: three sure ones on one base (optimizers only), then a point-only one of another
        // base, then one that does not fit.
        let ranked = [
            candidate(Options::default(), true, true),
            candidate(with(OptimizerChoice::Lion), true, true),
            candidate(with(OptimizerChoice::Adafactor), true, true),
            candidate(half, true, false),
            candidate(Options::default(), false, false),
        ];
        // Another base first (a trial of it tells more), the sure ones before it within each pass.
        assert_eq!(chosen(&ranked, 3), [0, 3, 1]);
        assert_eq!(chosen(&ranked, 4), [0, 3, 1, 2]);
        // Of candidates on different bases, the sure ones first.
        let checkpoint = Options {
            checkpoint: Some(None),
            ..Options::default()
        };
        let mixed = [
            candidate(Options::default(), true, true),
            candidate(bf16(), true, false),
            candidate(checkpoint, true, true),
        ];
        assert_eq!(chosen(&mixed, 2), [0, 2]);
        let line = fitting_line(&ranked, 1 << 30);
        assert!(
            line.starts_with("5 combinations predicted; 4 predicted to fit in 1.0 GiB (1 of them"),
            "{line}"
        );
        assert!(!fitting_line(&ranked[..3], 1 << 30).contains("of them"));
    }
}
