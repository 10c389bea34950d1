//! The loop's peak from its operators: a line per operator instead of one through the trials'
//! peaks.
//!
//! A trial records, for each top-level operator of its last step, the bytes allocated when it
//! began (`start`) and how far above them it went (`excess`: outputs, temporaries, workspace).
//! The step's peak is the largest `start + excess`. Two trials line up operator by operator (the
//! same loop runs the same operators), so each `start` is a line in the batch (the tensors
//! alive then grow with it), and so is each `excess`, but for a workspace: cuDNN picks its
//! algorithm per shape, and the workspace of the one it picks at the target need not lie on the
//! line through two smaller batches (tch::vision's resnet18 on the H200: 72 and 144 MiB at 64
//! and 128, 86 MiB at 256). The operators whose excess weighs are therefore run alone at the
//! target's shapes (`tchmem::op_trace::replay`), and their excess measured there.

use std::collections::HashMap;

use tchmem_wire::op_trace::OpTrace;

use super::trial::Measured;

/// Operators whose excess reaches this share of the step's peak are replayed at the target.
pub const REPLAY_SHARE: f64 = 0.01;
/// At most this many are (the largest first): each runs alone, in a fraction of a millisecond.
const MAX_REPLAYED: usize = 256;

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

/// Two calibration trials whose operators line up.
#[derive(Debug, Clone, Copy)]
pub struct OpLines<'a> {
    small: Point<'a>,
    large: Point<'a>,
}

#[derive(Debug, Clone, Copy)]
struct Point<'a> {
    batch: u64,
    begin: u64,
    ops: &'a OpTrace,
}

impl<'a> OpLines<'a> {
    /// The last two points that recorded their operators, if those are the same operators in
    /// the same order at two batch sizes.
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
        let first_difference = small
            .ops
            .ops
            .iter()
            .zip(&large.ops.ops)
            .position(|(a, b)| a.name != b.name);
        let same = small.ops.ops.len() == large.ops.ops.len() && first_difference.is_none();
        if !same {
            // Said where a developer looks: the estimate then keeps its lines through the trials.
            tracing::debug!(
                "the trials' operators differ ({} at batch {}, {} at {}){}: no replay",
                small.ops.ops.len(),
                small.batch,
                large.ops.ops.len(),
                large.batch,
                first_difference.map_or(String::new(), |i| format!(
                    ", first at #{i}: {} and {}",
                    small.ops.ops[i].name, large.ops.ops[i].name
                ))
            );
        }
        (same && small.batch < large.batch).then_some(OpLines {
            small: *small,
            large: *large,
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

    /// Operator `i`'s start above what the notebook held, at `micro`.
    fn start(&self, i: usize, micro: u64) -> f64 {
        let above = |p: &Point| p.ops.ops[i].start.saturating_sub(p.begin) as f64;
        self.line(above(&self.small), above(&self.large), micro)
    }

    /// Operator `i`'s excess on its line at `micro`.
    fn excess_line(&self, i: usize, micro: u64) -> f64 {
        let excess = |p: &Point| p.ops.ops[i].excess as f64;
        self.line(excess(&self.small), excess(&self.large), micro)
            .max(0.0)
    }

    /// The step's peak above what the notebook held, at `micro`: the largest start + excess,
    /// with the excess measured where `replayed` (at `micro`) has it.
    pub fn peak(&self, micro: u64, replayed: Option<&Replayed>) -> f64 {
        let replayed = replayed.filter(|r| r.micro == micro);
        (0..self.small.ops.ops.len())
            .map(|i| {
                let excess = replayed
                    .and_then(|r| r.excess.get(&i))
                    .map_or_else(|| self.excess_line(i, micro), |&bytes| bytes as f64);
                self.start(i, micro).max(0.0) + excess
            })
            .fold(0.0, f64::max)
    }

    /// The operators to replay at `micro`: those whose excess, in either trial or on its line
    /// there, reaches [`REPLAY_SHARE`] of the step's peak on the lines; the largest first.
    pub fn heaviest(&self, micro: u64) -> Vec<usize> {
        let threshold = REPLAY_SHARE * self.peak(micro, None);
        let mut weighed: Vec<(usize, f64)> = (0..self.small.ops.ops.len())
            .map(|i| {
                let most = (self.small.ops.ops[i].excess as f64)
                    .max(self.large.ops.ops[i].excess as f64)
                    .max(self.excess_line(i, micro));
                (i, most)
            })
            .filter(|(_, most)| *most >= threshold && *most > 0.0)
            .collect();
        weighed.sort_by(|a, b| b.1.total_cmp(&a.1));
        weighed.truncate(MAX_REPLAYED);
        let mut indices: Vec<usize> = weighed.into_iter().map(|(i, _)| i).collect();
        indices.sort_unstable();
        indices
    }

    /// How many operators the lines have.
    pub fn operators(&self) -> usize {
        self.small.ops.ops.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tchmem_wire::op_trace::OpCost;

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
        assert_eq!(lines.heaviest(32), vec![0, 1, 2]);
    }

    #[test]
    fn trials_whose_operators_differ_give_no_lines() {
        let mut other = trial(16, 2, 16);
        other.1.ops.as_mut().unwrap().ops.pop();
        assert!(OpLines::of(&[trial(8, 1, 8), other]).is_none());
        let mut renamed = trial(16, 2, 16);
        renamed.1.ops.as_mut().unwrap().ops[1].name = "aten::linear".into();
        assert!(OpLines::of(&[trial(8, 1, 8), renamed]).is_none());
        // One recorded trial is no line.
        let (b, mut bare) = trial(8, 1, 8);
        bare.ops = None;
        assert!(OpLines::of(&[(b, bare), trial(16, 2, 16)]).is_none());
    }
}
