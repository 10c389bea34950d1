//! `%%optimize --fit`'s candidates: combinations of the rewrites, predicted from calibrations and
//! ranked, fitting ones first, fastest first.

use tchmem_wire::estimate::OptimizerRule;

use super::estimate::{Calibration, Prediction, Scenario};
use crate::rewrite::{Amp, OptimizerChoice, Options};

/// What a candidate changes apart from accumulation and the optimizer: the rewrites that need
/// their own calibration (they change what the forward and backward passes keep).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Base {
    /// Activation checkpointing.
    pub checkpoint: bool,
    /// bf16 autocast.
    pub bf16: bool,
    /// The fused loss (where the loop's loss is a cross-entropy over a linear head).
    pub fused_loss: bool,
    /// The leanest: the segments' inputs offloaded and the optimizer stepped in backward (with
    /// checkpointing, bf16 and the fused loss); no accumulation (its gradients must live).
    pub lean: bool,
}

impl Base {
    /// The bases `--fit` calibrates: checkpointing and bf16, each with and without the fused
    /// loss, then the leanest.
    pub fn all() -> Vec<Base> {
        let mut all = Vec::new();
        for fused_loss in [false, true] {
            for (checkpoint, bf16) in [(false, false), (true, false), (false, true), (true, true)] {
                all.push(Base {
                    checkpoint,
                    bf16,
                    fused_loss,
                    lean: false,
                });
            }
        }
        all.push(Base {
            checkpoint: true,
            bf16: true,
            fused_loss: true,
            lean: true,
        });
        all
    }

    /// The rewrites of this base.
    pub fn options(self) -> Options {
        Options {
            checkpoint: self.checkpoint.then_some(None),
            amp: self.bf16.then_some(Amp::Bf16),
            fused_loss: self.fused_loss.then_some(None),
            offload: self.lean,
            step_in_backward: self.lean,
            ..Options::default()
        }
    }
}

/// The optimizers `--fit` may swap in, with their rules.
pub const OPTIMIZERS: [(OptimizerChoice, OptimizerRule); 3] = [
    (OptimizerChoice::Adafactor, OptimizerRule::Adafactor),
    (OptimizerChoice::AdamW8bit, OptimizerRule::AdamW8bit),
    (OptimizerChoice::Lion, OptimizerRule::Lion),
];

/// A leaner optimizer `--fit` may swap in, and what its step adds to a step's time where a
/// trial timed it against the cell's own (the calibration trials all run the cell's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Swap {
    /// The optimizer the rewrite puts in.
    pub choice: OptimizerChoice,
    /// Its state's rule.
    pub rule: OptimizerRule,
    /// Seconds its step takes more than the cell's optimizer's (fewer where negative), once per
    /// step; `None` where no trial timed both (the prediction keeps the cell's optimizer's time).
    pub added_seconds: Option<f64>,
}

/// The optimizers `--fit` ranks: the cell's own, and the swaps it may make.
#[derive(Debug, Clone, PartialEq)]
pub struct Optimizers {
    /// The rule of the cell's optimizer.
    pub cell: OptimizerRule,
    /// The leaner ones that apply.
    pub swaps: Vec<Swap>,
}

impl Optimizers {
    /// The cell's optimizer and every leaner one of [`OPTIMIZERS`], none timed.
    pub fn untimed(cell: OptimizerRule) -> Optimizers {
        Optimizers {
            cell,
            swaps: OPTIMIZERS
                .iter()
                .map(|&(choice, rule)| Swap {
                    choice,
                    rule,
                    added_seconds: None,
                })
                .collect(),
        }
    }
}

/// Micro-batch counts `--fit` tries.
pub const ACCUMULATE: [u64; 5] = [1, 2, 4, 8, 16];

/// One combination and its prediction.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// The rewrites (empty: the loop as written).
    pub options: Options,
    /// The prediction at the cell's batch.
    pub prediction: Prediction,
    /// Whether the predicted peak reserved stays within the budget.
    pub fits: bool,
    /// Whether it stays within even at the high end of the peak reserved range (as `fits` where
    /// the prediction has no range).
    pub fits_at_high: bool,
}

impl Candidate {
    /// How many rewrites it applies (fewer is preferred at equal speed).
    pub fn changes(&self) -> usize {
        let o = &self.options;
        o.checkpoint.is_some() as usize
            + o.amp.is_some() as usize
            + o.accumulate.is_some() as usize
            + o.optimizer.is_some() as usize
            + o.fused_loss.is_some() as usize
            + o.offload as usize
            + o.compress.is_some() as usize
            + o.step_in_backward as usize
    }
}

/// Every combination of the calibrated bases with accumulation (up to the batch) and the
/// optimizers (the cell's own, and the swaps, each with its step's time where it was timed),
/// predicted at `batch` and ranked: those
/// whose predicted peak reserved plus `context` stays within `budget` even at the high end of
/// its range first, then those that fit at the point only, each fastest first (within 2%, the one
/// with fewer rewrites and the cell's own optimizer first); then the rest, smallest peak first.
pub fn ranked(
    calibrations: &[(Base, Calibration)],
    optimizers: &Optimizers,
    batch: u64,
    begin: u64,
    budget: u64,
    context: u64,
) -> Vec<Candidate> {
    let mut all = Vec::new();
    for (base, calibration) in calibrations {
        let swaps = optimizers
            .swaps
            .iter()
            .map(|s| (Some(s.choice), s.rule, s.added_seconds));
        for (choice, rule, added) in std::iter::once((None, optimizers.cell, None)).chain(swaps) {
            // Stepping in backward frees each gradient at once: nothing to accumulate into.
            let accumulates = |k: u64| k == 1 || !base.lean;
            for &k in ACCUMULATE.iter().filter(|&&k| k <= batch && accumulates(k)) {
                let scenario = Scenario {
                    batch,
                    accumulate: k,
                    rule,
                    begin,
                    zero_ranks: None,
                };
                let Some(mut prediction) = calibration.predict(&scenario) else {
                    continue;
                };
                if let Some(added) = added {
                    prediction = prediction.with_optimizer_step_added(added);
                }
                let options = Options {
                    accumulate: (k > 1).then_some(k as u32),
                    optimizer: choice,
                    ..base.options()
                };
                let fits = prediction.peak_reserved + context <= budget;
                let fits_at_high = prediction.peak_reserved_high() + context <= budget;
                all.push(Candidate {
                    options,
                    prediction,
                    fits,
                    fits_at_high,
                });
            }
        }
    }
    // A total order first (fitting ones by time, sure ones before those that fit at the point
    // only; the rest by peak); then, among the first class's candidates within 2% of the
    // fastest, fewer rewrites first (a comparator that mixed both would not be an order).
    let class = |c: &Candidate| (c.fits_at_high, c.fits);
    all.sort_by(|a, b| {
        class(b).cmp(&class(a)).then_with(|| {
            if a.fits {
                a.prediction
                    .step_seconds
                    .total_cmp(&b.prediction.step_seconds)
            } else {
                a.prediction.peak_reserved.cmp(&b.prediction.peak_reserved)
            }
        })
    });
    if let Some(first) = all.first().filter(|c| c.fits).cloned() {
        let fastest = first.prediction.step_seconds;
        let close = all
            .iter()
            .take_while(|c| {
                class(c) == class(&first) && c.prediction.step_seconds <= fastest * 1.02
            })
            .count();
        all[..close].sort_by_key(Candidate::changes);
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fit::estimate::tests::simulated;
    use crate::fit::trial::Measured;

    const MIB: u64 = 1 << 20;

    /// A calibration whose trials cost `scale` times the plain loop's activations and `speed`
    /// times its step time.
    fn calibration(scale: f64, speed: f64) -> Calibration {
        let points = [8u64, 16]
            .iter()
            .map(|&b| {
                let plain = simulated(b, 0, &OptimizerRule::Adam);
                let fixed = plain.step.unwrap()
                    - crate::fit::estimate::tests::shapes()
                        .iter()
                        .map(|s| s.bytes())
                        .sum::<u64>();
                let fb = fixed + ((plain.forward_backward.unwrap() - fixed) as f64 * scale) as u64;
                let peak = fb.max(plain.step.unwrap());
                (
                    b,
                    Measured {
                        forward_backward: Some(fb),
                        peak_allocated: peak,
                        peak_reserved: peak + peak / 10,
                        step_seconds: plain.step_seconds * speed,
                        step_range: (plain.step_range.0 * speed, plain.step_range.1 * speed),
                        ..plain
                    },
                )
            })
            .collect();
        Calibration {
            points,
            rule: OptimizerRule::Adam,
            gradients_in_backward: false,
            replayed: None,
        }
    }

    /// Adam in the cell, every leaner optimizer untimed.
    fn adam() -> Optimizers {
        Optimizers::untimed(OptimizerRule::Adam)
    }

    fn recorded() -> Vec<(Base, Calibration)> {
        let all = Base::all();
        let [plain, checkpoint, bf16, both] = [all[0], all[1], all[2], all[3]];
        vec![
            (plain, calibration(1.0, 1.0)),
            (checkpoint, calibration(0.3, 1.3)),
            (bf16, calibration(0.5, 0.6)),
            (both, calibration(0.15, 0.8)),
        ]
    }

    #[test]
    fn the_fastest_fitting_combination_ranks_first() {
        // Everything fits in a large budget: bf16 alone is the fastest.
        let all = ranked(&recorded(), &adam(), 64, 0, 1 << 40, 0);
        assert!(all.iter().all(|c| c.fits));
        assert_eq!(all[0].options.flags(), "--amp bf16");
        // The loop as written needs ~270 MiB at batch 64; with 200 MiB, bf16 alone does not fit
        // (~170 MiB + cache): the ranking takes the fastest that does.
        let budget = 200 * MIB;
        let all = ranked(&recorded(), &adam(), 64, 0, budget, 0);
        let first = &all[0];
        assert!(first.fits, "{first:?}");
        assert!(first.prediction.peak_reserved <= budget);
        // (Those that fit at the point of a range only rank after the sure ones, however fast.)
        for other in all.iter().filter(|c| c.fits_at_high) {
            assert!(
                other.prediction.step_seconds >= first.prediction.step_seconds * 0.98,
                "{} is faster than {}",
                other.options.flags(),
                first.options.flags()
            );
        }
        // The ones that do not fit come last, smallest first.
        let misses: Vec<&Candidate> = all.iter().filter(|c| !c.fits).collect();
        assert!(!misses.is_empty());
        assert!(misses
            .windows(2)
            .all(|w| w[0].prediction.peak_reserved <= w[1].prediction.peak_reserved));
        // Accumulation is only tried up to the batch.
        let small = ranked(&recorded(), &adam(), 2, 0, budget, 0);
        assert!(small.iter().all(|c| c.options.accumulate.unwrap_or(1) <= 2));
    }

    #[test]
    fn a_swapped_optimizer_is_ranked_at_the_time_its_own_step_was_measured_to_take() {
        let step = |all: &[Candidate], flags: &str| {
            all.iter()
                .find(|c| c.options.flags() == flags)
                .map(|c| c.prediction.step_seconds)
                .unwrap()
        };
        // Untimed, a swap takes the cell's optimizer's time: bf16 with Adam ranks first (fewer
        // rewrites at the same time).
        let untimed = ranked(&recorded(), &adam(), 64, 0, 1 << 40, 0);
        assert_eq!(untimed[0].options.flags(), "--amp bf16");
        let bf16 = step(&untimed, "--amp bf16");
        assert_eq!(step(&untimed, "--amp bf16 --optimizer lion"), bf16);
        // Lion's step measured 10 ms shorter, Adafactor's 25 ms longer.
        let mut timed = adam();
        for swap in &mut timed.swaps {
            swap.added_seconds = match swap.choice {
                OptimizerChoice::Lion => Some(-0.010),
                OptimizerChoice::Adafactor => Some(0.025),
                _ => None,
            };
        }
        let all = ranked(&recorded(), &timed, 64, 0, 1 << 40, 0);
        assert_eq!(all[0].options.flags(), "--amp bf16 --optimizer lion");
        let lion = step(&all, "--amp bf16 --optimizer lion");
        assert!((lion - (bf16 - 0.010)).abs() < 1e-9, "{lion} {bf16}");
        // Once per step, however many micro-batches: the optimizer steps once.
        let four = step(&all, "--amp bf16 --accumulate 4");
        let adafactor_four = step(&all, "--amp bf16 --accumulate 4 --optimizer adafactor");
        assert!((adafactor_four - four - 0.025).abs() < 1e-9);
        let untimed_8bit = step(&untimed, "--optimizer adamw8bit");
        assert_eq!(step(&all, "--optimizer adamw8bit"), untimed_8bit);
        // The range moves with the point.
        let range = |flags: &str| {
            let c = all.iter().find(|c| c.options.flags() == flags).unwrap();
            (c.prediction.step_time.low, c.prediction.step_time.high)
        };
        let (low, high) = range("--amp bf16");
        let (lion_low, lion_high) = range("--amp bf16 --optimizer lion");
        assert!(
            (lion_low - (low - 0.010)).abs() < 1e-9 && (lion_high - (high - 0.010)).abs() < 1e-9
        );
    }

    #[test]
    fn a_candidate_that_fits_only_at_the_point_of_its_range_ranks_after_the_sure_ones() {
        // bf16 alone is the fastest, but its smaller calibration trial cached as much as its
        // loop peak where the larger cached a tenth: its peak reserved is a range whose high end
        // is far above the point.
        let mut bases = recorded();
        let (_, small) = &mut bases[2].1.points[0];
        small.peak_reserved = small.peak_allocated * 2;
        let roomy = ranked(&bases, &adam(), 64, 0, 1 << 40, 0);
        let bf16 = |all: &[Candidate]| {
            all.iter()
                .find(|c| c.options.flags() == "--amp bf16")
                .cloned()
                .unwrap()
        };
        let (point, high) = bf16(&roomy).prediction.reserved_spread.unwrap();
        assert!(high > point + point / 2, "{point} {high}");
        // A budget between its point and its high end.
        let budget = bf16(&roomy).prediction.peak_reserved + MIB;
        let all = ranked(&bases, &adam(), 64, 0, budget, 0);
        let unsure = bf16(&all);
        assert!(unsure.fits && !unsure.fits_at_high, "{unsure:?}");
        let first = &all[0];
        assert!(first.fits_at_high, "{first:?}");
        assert!(first.prediction.step_seconds > unsure.prediction.step_seconds);
        // Sure ones, then those that fit at the point only, then the rest.
        let class = |c: &Candidate| c.fits as u8 + c.fits_at_high as u8;
        assert!(all.windows(2).all(|w| class(&w[0]) >= class(&w[1])));
        assert!(all.iter().any(|c| !c.fits));
    }

    #[test]
    fn the_leanest_base_never_accumulates_and_counts_its_rewrites() {
        let all = Base::all();
        assert_eq!(all.len(), 9);
        assert_eq!(all.iter().filter(|b| b.fused_loss).count(), 5);
        let lean = *all.last().unwrap();
        assert_eq!(
            lean.options().flags(),
            "--checkpoint --amp bf16 --offload --fused-loss --step-in-backward"
        );
        let ranked = ranked(&[(lean, calibration(0.1, 0.9))], &adam(), 64, 0, 1 << 40, 0);
        // The cell's optimizer and the three leaner ones, each without accumulation.
        assert_eq!(ranked.len(), 4);
        assert!(ranked.iter().all(|c| c.options.accumulate.is_none()));
        let own = ranked
            .iter()
            .find(|c| c.options.optimizer.is_none())
            .unwrap();
        assert_eq!(own.changes(), 5);
    }
}
