//! The loop's peak from its operators: a line per operator instead of one through the trials'
//! peaks.
//!
//! A trial records, for each top-level operator of its last step, the bytes allocated when it
//! began (`start`) and how far above them it went (`excess`: outputs, temporaries, workspace).
//! The step's peak is the largest `start + excess`. Two trials line up operator by operator (the
//! same loop runs the same operators; those only the larger ran, one per sample say, are paired
//! around by name), so each `start` is a line in the batch (the tensors
//! alive then grow with it), and so is each `excess`, but for a workspace: cuDNN picks its
//! algorithm per shape, and the workspace of the one it picks at the target need not lie on the
//! line through two smaller batches (tch::vision's resnet18 on the H200: 72 and 144 MiB at 64
//! and 128, 86 MiB at 256). The operators whose excess weighs are therefore run alone at the
//! target's shapes (`tchmem::op_trace::replay`), and their excess measured there.

use std::collections::HashMap;

use tchmem_wire::op_trace::{OpCost, OpReplay, OpTrace};

use super::edit_script::{self, Runs};
use super::trial::Measured;

/// Operators whose excess reaches this share of the step's peak are replayed at the target.
pub const REPLAY_SHARE: f64 = 0.01;
/// At most this many are (the largest first): each runs alone, in a fraction of a millisecond.
const MAX_REPLAYED: usize = 256;
/// The share of the smaller trial's operators that must find their twin in the larger's, by
/// name, for the two to be one loop's steps.
const MIN_PAIRED: f64 = 0.9;

/// Operators replayed alone at one micro-batch: operator index → excess in bytes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Replayed {
    /// The micro-batch they ran at.
    pub micro: u64,
    /// Excess by operator index; operators that could not run are absent (their line holds).
    pub excess: HashMap<usize, u64>,
    /// The sizes each requested from the allocator while it ran, by operator index (CUDA).
    pub allocations: HashMap<usize, Vec<u64>>,
}

impl Replayed {
    /// What the child answered for operators `pairs` (each one's index in the smaller and the
    /// larger trial's recording) run alone at `micro`, by the larger trial's index, as its
    /// allocator trace marks its operators: those that ran, and those that requested anything.
    pub fn of(micro: u64, pairs: &[(usize, usize)], answer: OpReplay) -> Replayed {
        let excess = pairs
            .iter()
            .zip(answer.excess)
            .filter_map(|(&(_, j), bytes)| Some((j, bytes?)))
            .collect();
        let allocations = pairs
            .iter()
            .zip(answer.allocations)
            .filter(|(_, sizes)| !sizes.is_empty())
            .map(|(&(_, j), sizes)| (j, sizes))
            .collect();
        Replayed {
            micro,
            excess,
            allocations,
        }
    }
}

/// Two calibration trials whose operators line up.
#[derive(Debug, Clone)]
pub struct OpLines<'a> {
    small: Point<'a>,
    large: Point<'a>,
    /// For each of the larger trial's operators, the same operator's index in the smaller
    /// trial's, if it ran there (a batch built from one operator per sample runs more of them
    /// at the larger batch).
    pairs: Vec<Option<usize>>,
}

#[derive(Debug, Clone, Copy)]
struct Point<'a> {
    batch: u64,
    begin: u64,
    ops: &'a OpTrace,
}

impl<'a> OpLines<'a> {
    /// The last two points that recorded their operators, if those are the same operators in
    /// the same order at two batch sizes, but for some that only the larger ran: at least
    /// [`MIN_PAIRED`] of the smaller trial's find their twin by name, and the larger ran no more
    /// others than operators in proportion to the batch would add (a batch built from one
    /// operator per sample runs more of them at the larger batch).
    pub fn of(points: &'a [(u64, Measured)]) -> Option<OpLines<'a>> {
        let recorded: Vec<Point<'a>> = points
            .iter()
            .filter_map(|(batch, m)| {
                let ops = m.ops.as_ref().filter(|ops| !ops.ops.is_empty())?;
                Some(Point {
                    batch: *batch,
                    begin: m.begin,
                    ops,
                })
            })
            .collect();
        let [.., small, large] = recorded.as_slice() else {
            return None;
        };
        let pairs = paired_by_name(&small.ops.ops, &large.ops.ops);
        let lined_up = pairs.iter().flatten().count();
        let (n1, n2) = (small.ops.ops.len() as f64, large.ops.ops.len() as f64);
        let extra = n2 - lined_up as f64;
        let grown = small.batch < large.batch
            && extra <= n1 * (large.batch as f64 / small.batch as f64 - 1.0);
        let enough = lined_up as f64 >= MIN_PAIRED * n1 && grown;
        if lined_up < large.ops.ops.len() {
            // Said where a developer looks: without enough pairs, the estimate keeps its lines.
            let first = pairs.iter().position(Option::is_none).unwrap_or_default();
            tracing::debug!(
                "the trials' operators differ ({n1} at batch {}, {n2} at {}; the first unpaired \
                 at #{first}: {}): {lined_up} pair up{}",
                small.batch,
                large.batch,
                large.ops.ops[first].name,
                if enough { "" } else { ", too few: no replay" }
            );
        }
        enough.then_some(OpLines {
            small: *small,
            large: *large,
            pairs,
        })
    }

    /// The two recordings' identifiers in the child and their batches, for a replay.
    pub fn recordings(&self) -> ((u64, u64), (u64, u64)) {
        (
            (self.small.ops.id, self.large.ops.id),
            (self.small.batch, self.large.batch),
        )
    }

    fn line(&self, small: f64, large: f64, at: u64) -> f64 {
        let (b1, b2) = (self.small.batch as f64, self.large.batch as f64);
        small + (large - small) * (at as f64 - b1) / (b2 - b1)
    }

    /// `value` of the larger trial's operator `j` at `micro`, on its line through the smaller
    /// trial's twin (`None` where it has none).
    fn paired(&self, j: usize, micro: u64, value: impl Fn(&Point, usize) -> f64) -> Option<f64> {
        let i = self.pairs[j]?;
        Some(self.line(value(&self.small, i), value(&self.large, j), micro))
    }

    /// Operator `j`'s start above what the notebook held, at `micro`. One only the larger trial
    /// ran starts where the nearest paired operator before it does at `micro`, plus what came
    /// between them in the larger trial in proportion to the batch (a start is a level: the
    /// model's state under it does not grow with the batch).
    fn start(&self, j: usize, micro: u64) -> f64 {
        let above = |p: &Point, k: usize| p.ops.ops[k].start.saturating_sub(p.begin) as f64;
        if let Some(start) = self.paired(j, micro, above) {
            return start;
        }
        match (0..j).rev().find(|&k| self.pairs[k].is_some()) {
            Some(k) => {
                let between = above(&self.large, j) - above(&self.large, k);
                self.paired(k, micro, above).unwrap_or_default()
                    + between * micro as f64 / self.large.batch as f64
            }
            None => above(&self.large, j),
        }
    }

    /// Operator `j`'s excess on its line at `micro`; for one only the larger trial ran, its
    /// excess there (one per sample, each of one sample's size).
    fn excess_line(&self, j: usize, micro: u64) -> f64 {
        self.paired(j, micro, |p, k| p.ops.ops[k].excess as f64)
            .unwrap_or(self.large.ops.ops[j].excess as f64)
            .max(0.0)
    }

    /// The step's peak above what the notebook held, at `micro`: the largest start + excess,
    /// with the excess measured where `replayed` (at `micro`) has it.
    pub fn peak(&self, micro: u64, replayed: Option<&Replayed>) -> f64 {
        let replayed = replayed.filter(|r| r.micro == micro);
        (0..self.large.ops.ops.len())
            .map(|j| {
                let excess = replayed
                    .and_then(|r| r.excess.get(&j))
                    .map_or_else(|| self.excess_line(j, micro), |&bytes| bytes as f64);
                self.start(j, micro).max(0.0) + excess
            })
            .fold(0.0, f64::max)
    }

    /// The operators to replay at `micro`, as (index in the smaller trial, in the larger):
    /// those of both whose excess, in either trial or on its line there, reaches
    /// [`REPLAY_SHARE`] of the step's peak on the lines; the largest first. A replay and its
    /// results go by the larger trial's index.
    pub fn heaviest(&self, micro: u64) -> Vec<(usize, usize)> {
        let threshold = REPLAY_SHARE * self.peak(micro, None);
        let mut weighed: Vec<((usize, usize), f64)> = self
            .pairs
            .iter()
            .enumerate()
            .filter_map(|(j, i)| Some((i.as_ref().copied()?, j)))
            .map(|(i, j)| {
                let most = (self.small.ops.ops[i].excess as f64)
                    .max(self.large.ops.ops[j].excess as f64)
                    .max(self.excess_line(j, micro));
                ((i, j), most)
            })
            .filter(|(_, most)| *most >= threshold && *most > 0.0)
            .collect();
        weighed.sort_by(|a, b| b.1.total_cmp(&a.1));
        weighed.truncate(MAX_REPLAYED);
        let mut pairs: Vec<(usize, usize)> = weighed.into_iter().map(|(pair, _)| pair).collect();
        pairs.sort_unstable();
        pairs
    }

    /// How many operators the lines have (the larger trial's).
    pub fn operators(&self) -> usize {
        self.large.ops.ops.len()
    }
}

/// For each of `large`'s operators, the index of the same operator in `small`, by name (equal
/// runs of the edit script only: the rest ran in one step only). Past the diff's deadline what
/// it paired by then stands.
fn paired_by_name(small: &[OpCost], large: &[OpCost]) -> Vec<Option<usize>> {
    fn names(ops: &[OpCost]) -> Vec<&str> {
        ops.iter().map(|op| op.name.as_str()).collect()
    }
    edit_script::pairs(&names(small), &names(large), Runs::Equal).0
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// A step of a conv net at `batch`: the batch copied in (1 MiB a sample), a convolution
    /// whose workspace is `workspace` MiB, its backward, the optimizer's step.
    fn trial(batch: u64, id: u64, workspace: u64) -> (u64, Measured) {
        let begin = 100 * MIB;
        let op = |name: &str, start: u64, excess: u64| OpCost {
            name: name.into(),
            start: begin + start,
            excess,
        };
        let ops = vec![
            op("aten::to", 50 * MIB, batch * MIB),
            op("aten::conv2d", 50 * MIB + batch * MIB, 2 * batch * MIB),
            op(
                "aten::convolution_backward",
                50 * MIB + 3 * batch * MIB,
                batch * MIB + workspace * MIB,
            ),
            op("aten::add_", 50 * MIB, 0),
        ];
        let measured = Measured {
            cuda: true,
            begin,
            ops: Some(OpTrace { id, ops }),
            ..Measured::default()
        };
        (batch, measured)
    }

    #[test]
    fn each_start_and_excess_is_a_line_through_the_two_trials() {
        // Workspace in proportion to the batch: the lines alone are exact.
        let points = [trial(8, 1, 8), trial(16, 2, 16)];
        let lines = OpLines::of(&points).unwrap();
        assert_eq!(lines.operators(), 4);
        assert_eq!(lines.recordings(), ((1, 2), (8, 16)));
        // At 32: backward starts at 50 + 96 and adds 32 + 32.
        assert_eq!(lines.peak(32, None), (50 + 96 + 64) as f64 * MIB as f64);
    }

    #[test]
    fn a_replayed_excess_replaces_its_line_at_its_batch_only() {
        // cuDNN chose another algorithm at 32: 4 MiB of workspace, not the line's 32.
        let points = [trial(8, 1, 8), trial(16, 2, 16)];
        let lines = OpLines::of(&points).unwrap();
        let replayed = Replayed {
            micro: 32,
            excess: HashMap::from([(2, 36 * MIB)]),
            ..Replayed::default()
        };
        assert_eq!(
            lines.peak(32, Some(&replayed)),
            (50 + 96 + 36) as f64 * MIB as f64
        );
        // At another batch the replay says nothing.
        assert_eq!(
            lines.peak(64, Some(&replayed)),
            lines.peak(64, None),
            "a replay at 32 is not used at 64"
        );
    }

    #[test]
    fn the_operators_that_weigh_are_replayed() {
        let points = [trial(8, 1, 8), trial(16, 2, 16)];
        let lines = OpLines::of(&points).unwrap();
        // The add has no excess; the others weigh over 1% of the peak.
        assert_eq!(lines.heaviest(32), vec![(0, 0), (1, 1), (2, 2)]);
    }

    #[test]
    fn operators_one_step_ran_alone_are_left_out_of_the_pairs() {
        // The batch built from one `narrow` per sample: 8 at 8, 16 at 16, before the step.
        // Each narrow starts above the model's 50 MiB and the samples before it (1 MiB each),
        // and takes one sample's 1 MiB.
        let with_samples = |(batch, mut m): (u64, Measured)| {
            let begin = m.begin;
            let ops = &mut m.ops.as_mut().unwrap().ops;
            let narrows = (0..batch).map(|k| OpCost {
                name: "aten::narrow".into(),
                start: begin + 50 * MIB + k * MIB,
                excess: MIB,
            });
            ops.splice(0..0, narrows);
            (batch, m)
        };
        let plain = [trial(8, 1, 8), trial(16, 2, 16)];
        let built = [with_samples(trial(8, 1, 8)), with_samples(trial(16, 2, 16))];
        let lines = OpLines::of(&built).unwrap();
        assert_eq!(lines.operators(), 20);
        // The step's operators pair across the offset, and the peak is the plain step's.
        assert_eq!(lines.heaviest(32), vec![(8, 16), (9, 17), (10, 18)]);
        let plain_lines = OpLines::of(&plain).unwrap();
        assert_eq!(lines.peak(32, None), plain_lines.peak(32, None));
        // The narrows only the larger ran (its 9th to 16th) start from the 8th's level at 32,
        // with the samples between in proportion: not the model's 50 MiB doubled.
        let last = lines.start(15, 32) / MIB as f64;
        assert_eq!(last, 50.0 + 7.0 + 8.0 * 2.0, "{last}");
        assert_eq!(lines.excess_line(15, 32), MIB as f64);
        // A replay goes by the larger trial's index.
        let replayed = Replayed {
            micro: 32,
            excess: HashMap::from([(18, 36 * MIB)]),
            ..Replayed::default()
        };
        assert_eq!(
            lines.peak(32, Some(&replayed)),
            (50 + 96 + 36) as f64 * MIB as f64
        );
    }

    #[test]
    fn trials_whose_operators_differ_give_no_lines() {
        // One the larger trial lacks (the smaller's share paired is 3 of 4).
        let mut other = trial(16, 2, 16);
        other.1.ops.as_mut().unwrap().ops.pop();
        assert!(OpLines::of(&[trial(8, 1, 8), other]).is_none());
        // More unpaired operators than the batch's growth explains.
        let mut more = trial(16, 2, 16);
        let extra = more.1.ops.as_ref().unwrap().ops[3].clone();
        more.1
            .ops
            .as_mut()
            .unwrap()
            .ops
            .extend(std::iter::repeat_n(extra, 5).map(|op| OpCost {
                name: "aten::mul".into(),
                ..op
            }));
        assert!(OpLines::of(&[trial(8, 1, 8), more]).is_none());
        let mut renamed = trial(16, 2, 16);
        renamed.1.ops.as_mut().unwrap().ops[1].name = "aten::linear".into();
        assert!(OpLines::of(&[trial(8, 1, 8), renamed]).is_none());
        // One recorded trial is no line.
        let (b, mut bare) = trial(8, 1, 8);
        bare.ops = None;
        assert!(OpLines::of(&[(b, bare), trial(16, 2, 16)]).is_none());
    }
}
