//! The batch-size search of `%memfit`: trials until the largest batch that fits is bracketed.
//!
//! It grows from the cell's batch (doubling, or straight to where a line through the fitting
//! trials' peaks meets the limit, at most 16 times further), then narrows the bracket between
//! the largest batch that fit and the smallest that did not, aiming each trial at the line's
//! crossing, probing just above a batch that fit where the line says the maximum is, and falling
//! back to the midpoint when the line misleads. A trial fits when it ran without running out of memory
//! and its peak reserved bytes stay under the capacity less the safety margin.

/// The allocator's room and the margin to keep free.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// Bytes the allocator may reserve (the device's, or its memory fraction's).
    pub capacity: u64,
    /// Fraction of `capacity` to keep free (0.1: 10%).
    pub margin: f64,
    /// Most trials.
    pub max_trials: usize,
}

impl Limits {
    /// The most a fitting trial may reserve.
    pub fn allowed(&self) -> u64 {
        (self.capacity as f64 * (1.0 - self.margin)) as u64
    }
}

/// What one trial said.
#[derive(Debug, Clone, PartialEq)]
pub enum Probe {
    /// It ran; its peak reserved bytes.
    Ran { peak_reserved: u64 },
    /// It ran out of memory.
    OutOfMemory,
}

/// A trial's verdict, as the search saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Ran, under the margin.
    Fits,
    /// Ran, but over the margin.
    OverMargin,
    /// Ran out of memory.
    OutOfMemory,
}

/// The search's result.
#[derive(Debug, Clone, PartialEq)]
pub struct Found {
    /// The largest batch that fit, if any did.
    pub batch: Option<u64>,
    /// The smallest batch that did not, if one was tried.
    pub too_big: Option<u64>,
    /// Every trial in order: batch, verdict, peak reserved (if it ran).
    pub trials: Vec<(u64, Verdict, Option<u64>)>,
}

/// How close the search brackets the largest batch that fits (a fraction of it).
const TOLERANCE: f64 = 0.02;

/// The batch a tolerance above `batch` (at least one more).
fn just_above(batch: u64) -> u64 {
    (batch + 1)
        .max((batch as f64 * (1.0 + TOLERANCE)).ceil() as u64)
        .min(MAX_BATCH)
}

/// Largest batch the search tries: memory that does not grow with the batch (nothing on the
/// GPU) would otherwise never bracket.
pub const MAX_BATCH: u64 = 1 << 20;

/// Searches from `start`, calling `probe` for each trial; `probe` may stop the search early by
/// returning `None` (an interrupt, an error that is not an OOM), which ends it with what is known.
pub fn search(
    start: u64,
    limits: Limits,
    mut probe: impl FnMut(u64, usize) -> Option<Probe>,
) -> Found {
    let allowed = limits.allowed();
    let mut found = Found {
        batch: None,
        too_big: None,
        trials: Vec::new(),
    };
    // (batch, peak reserved) of the trials that fit, for the line.
    let mut fitting: Vec<(u64, u64)> = Vec::new();
    let mut next = start.clamp(1, MAX_BATCH);
    // Whether the last bracket step moved the lower bound (to alternate with midpoints when the
    // line keeps landing on one side).
    let mut last_moved: Option<bool> = None;
    while found.trials.len() < limits.max_trials {
        let Some(result) = probe(next, found.trials.len() + 1) else {
            break;
        };
        let verdict = match result {
            Probe::Ran { peak_reserved } if peak_reserved <= allowed => {
                fitting.push((next, peak_reserved));
                Verdict::Fits
            }
            Probe::Ran { .. } => Verdict::OverMargin,
            Probe::OutOfMemory => Verdict::OutOfMemory,
        };
        let peak = match result {
            Probe::Ran { peak_reserved } => Some(peak_reserved),
            Probe::OutOfMemory => None,
        };
        found.trials.push((next, verdict, peak));
        let moved_lower = verdict == Verdict::Fits;
        if moved_lower {
            found.batch = Some(found.batch.map_or(next, |b| b.max(next)));
        } else {
            found.too_big = Some(found.too_big.map_or(next, |b| b.min(next)));
        }
        let (lo, hi) = (found.batch, found.too_big);
        let crossing = crossing(&fitting, allowed);
        next = match (lo, hi) {
            (None, Some(hi)) if hi <= 1 => break, // nothing fits
            (None, Some(hi)) => hi / 2,
            (Some(lo), None) if lo >= MAX_BATCH => break,
            (Some(lo), None) => match crossing {
                // The line says the largest batch that fits is about here: probe just above.
                Some(c) if c <= just_above(lo) => just_above(lo),
                Some(c) => c.clamp(lo + 1, lo.saturating_mul(16).min(MAX_BATCH)),
                None => (lo * 2).min(MAX_BATCH),
            },
            (Some(lo), Some(hi)) => {
                if hi - lo <= 1 || ((hi - 1 - lo) as f64) < lo as f64 * TOLERANCE {
                    break; // the maximum is known within the tolerance
                }
                let mid = lo + (hi - lo) / 2;
                let same_side_again = last_moved == Some(moved_lower);
                last_moved = Some(moved_lower);
                match crossing.filter(|c| *c > lo && *c < hi) {
                    // At the line's crossing already: a trial just above closes the bracket.
                    Some(c) if moved_lower && c <= just_above(lo) => just_above(lo).min(hi - 1),
                    // Not hard against the bound that failed: a line through points below
                    // the limit tends to overshoot it.
                    Some(c) if !same_side_again => c.min(hi - (hi - lo) / 8).max(lo + 1),
                    _ => mid,
                }
            }
            (None, None) => unreachable!("every trial sets a bound"),
        };
    }
    found
}

/// Where the line through the fitting trials' peaks reaches `allowed`: the largest batch it
/// says fits. `None` with fewer than two points or a line that does not grow.
fn crossing(fitting: &[(u64, u64)], allowed: u64) -> Option<u64> {
    let mut points = fitting.to_vec();
    points.sort_unstable();
    points.dedup_by_key(|(b, _)| *b);
    let [.., (b1, p1), (b2, p2)] = points.as_slice() else {
        return None;
    };
    let slope = (*p2 as f64 - *p1 as f64) / (*b2 as f64 - *b1 as f64);
    if slope <= 0.0 {
        return None;
    }
    let batch = *b2 as f64 + (allowed as f64 - *p2 as f64) / slope;
    Some(batch.floor().clamp(1.0, MAX_BATCH as f64) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    /// A simulated caching allocator: a loop needing `fixed + per_sample·b (+ quadratic·b²)`
    /// bytes, reserved in 2 MiB segments, out of memory beyond `limit`.
    struct Simulated {
        fixed: u64,
        per_sample: u64,
        quadratic: u64,
        limit: u64,
    }

    impl Simulated {
        fn reserved(&self, b: u64) -> u64 {
            (self.fixed + self.per_sample * b + self.quadratic * b * b).div_ceil(2 * MIB) * 2 * MIB
        }
        fn probe(&self, b: u64) -> Probe {
            match self.reserved(b) {
                r if r > self.limit => Probe::OutOfMemory,
                r => Probe::Ran { peak_reserved: r },
            }
        }
        /// The true answer: the largest batch whose reserved bytes stay under `allowed`.
        fn maximum(&self, allowed: u64) -> u64 {
            (1..MAX_BATCH)
                .take_while(|&b| self.reserved(b) <= allowed)
                .last()
                .unwrap_or(0)
        }
    }

    fn run(sim: &Simulated, start: u64, margin: f64) -> (Found, u64) {
        let limits = Limits {
            capacity: sim.limit,
            margin,
            max_trials: 8,
        };
        let found = search(start, limits, |b, _| Some(sim.probe(b)));
        (found, sim.maximum(limits.allowed()))
    }

    #[test]
    fn the_search_finds_the_maximum_in_at_most_eight_trials_and_keeps_the_margin() {
        let cases = [
            // A GPT-like loop: 3.5 GiB fixed, 1.4 GiB per sample, 80 GiB.
            (
                Simulated {
                    fixed: 3584 * MIB,
                    per_sample: 1434 * MIB,
                    quadratic: 0,
                    limit: 80 * GIB,
                },
                16,
            ),
            // Small samples, a big limit: many doublings before the line takes over.
            (
                Simulated {
                    fixed: 200 * MIB,
                    per_sample: 3 * MIB,
                    quadratic: 0,
                    limit: 40 * GIB,
                },
                8,
            ),
            // Attention-like growth: the line undershoots, the bracket corrects it.
            (
                Simulated {
                    fixed: GIB,
                    per_sample: 20 * MIB,
                    quadratic: MIB / 2,
                    limit: 16 * GIB,
                },
                4,
            ),
            // As the H200 measured an 8×4096 MLP: the cache grows faster near the limit.
            (
                Simulated {
                    fixed: 4300 * MIB,
                    per_sample: 190 * 1024,
                    quadratic: 1,
                    limit: 14 * GIB,
                },
                1024,
            ),
            // The start does not fit: halve first.
            (
                Simulated {
                    fixed: GIB,
                    per_sample: 100 * MIB,
                    quadratic: 0,
                    limit: 8 * GIB,
                },
                512,
            ),
        ];
        for (sim, start) in cases {
            for margin in [0.0, 0.1] {
                let (found, maximum) = run(&sim, start, margin);
                let batch = found.batch.expect("something fits");
                assert!(found.trials.len() <= 8, "{found:?}");
                // It never reports a batch over the margin...
                let allowed = (sim.limit as f64 * (1.0 - margin)) as u64;
                assert!(sim.reserved(batch) <= allowed, "{found:?}");
                // ...and is within 5% of the true maximum, or one step of the bracket.
                assert!(
                    batch as f64 >= maximum as f64 * 0.95 || maximum - batch <= 1,
                    "found {batch}, maximum {maximum}: {found:?}"
                );
                assert_eq!(found.trials[0].0, start);
            }
        }
    }

    #[test]
    fn when_nothing_fits_the_search_says_so() {
        let sim = Simulated {
            fixed: 10 * GIB,
            per_sample: GIB,
            quadratic: 0,
            limit: 8 * GIB,
        };
        let (found, _) = run(&sim, 4, 0.0);
        assert_eq!(found.batch, None);
        assert_eq!(found.too_big, Some(1));
        assert_eq!(
            found.trials.iter().map(|t| t.0).collect::<Vec<_>>(),
            [4, 2, 1]
        );
    }

    #[test]
    fn a_stopped_search_keeps_what_it_knows() {
        let limits = Limits {
            capacity: GIB,
            margin: 0.0,
            max_trials: 8,
        };
        let found = search(4, limits, |b, n| {
            (n < 3).then_some(Probe::Ran {
                peak_reserved: b * MIB,
            })
        });
        assert_eq!(found.batch, Some(8));
        assert_eq!(found.trials.len(), 2);
    }
}
