//! The estimate's replay: the calibration trials' heaviest operators run alone at the
//! micro-batch being predicted (see `fit::op_peak`), in the child that recorded them.

use tchmem_wire::op_trace::{OpReplay, OP_REPLAY_MIME};

use super::{study, Cells, Runner};
use crate::fit::estimate::Calibration;
use crate::fit::op_peak::{OpLines, Replayed};
use crate::session::CellIo;

/// The cell that replays operators `pairs` (each one's index in the two recordings) at `micro`.
pub(super) fn replay_code(lines: &OpLines<'_>, micro: u64, pairs: &[(usize, usize)]) -> String {
    let ((first, second), (b1, b2)) = lines.recordings();
    let pairs: Vec<String> = pairs.iter().map(|(i, j)| format!("({i}, {j})")).collect();
    format!(
        "tchmem::op_trace::replay({first}, {second}, ({b1}, {b2}), {micro}, &[{}])",
        pairs.join(", ")
    )
}

impl<R: Runner> Cells<R> {
    /// Runs `calibration`'s heaviest operators alone at `micro` and keeps what they measured in
    /// it. Without recorded operators, or when the replay fails, the calibration is left as it
    /// was (its lines through the trials' peaks predict).
    pub(super) fn replay_heaviest(&mut self, calibration: &mut Calibration, micro: u64) {
        let Some(lines) = OpLines::of(&calibration.points) else {
            return;
        };
        let pairs = lines.heaviest(micro);
        let answer = if pairs.is_empty() {
            Some(OpReplay::default())
        } else {
            let outcome = self.run(&replay_code(&lines, micro, &pairs), CellIo::quiet());
            let reply = outcome
                .data
                .get(OP_REPLAY_MIME)
                .and_then(|json| serde_json::from_str::<OpReplay>(json).ok());
            if let Some(reply) = &reply {
                study::keep_replay(micro, &pairs, reply);
            }
            reply.filter(|replay| replay.error.is_none())
        };
        let Some(answer) = answer else {
            tracing::info!("the operators' replay at {micro} gave no answer: lines only");
            return;
        };
        calibration.replayed = Some(Replayed::of(micro, &pairs, answer));
    }
}
