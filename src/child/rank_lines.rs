//! What the world's launcher does with each line a rank writes (see [`super::world`]): the
//! kernel talks to rank 0 as to any child, so rank 0's protocol lines pass as they are; every
//! rank's text is labelled with its rank; the other ranks' protocol lines are dropped, but for
//! the panics they report (labelled), their cell reports (whose memory records join rank 0's)
//! and what ends their cell.

use tchmem_wire::{CellMessage, CellReport, CELL_REPORT_MIME, MESSAGE_PREFIX, STDERR_SYNC_PREFIX};
use tchmem_wire::{EVCXR_BEGIN_CONTENT, EVCXR_END_CONTENT};

/// The line evcxr waits for after each cell.
pub const EXECUTION_COMPLETE: &str = "EVCXR_EXECUTION_COMPLETE";
/// The line evcxr's generated code prints when it caught a panic.
pub const PANIC_NOTIFICATION: &str = "EVCXR_PANIC_NOTIFICATION";
/// Lines of evcxr's protocol begin with it (input requests, lost variables, …).
const EVCXR_PROTOCOL: &str = "EVCXR_";
/// How a cell asks for a line of input (evcxr_input's request, password or not).
const INPUT_REQUEST: &str = "EVCXR_INPUT_REQUEST";

/// Where a line goes now.
#[derive(Debug, PartialEq, Eq)]
pub enum Routed {
    /// To the launcher's stdout.
    Stdout(String),
    /// To the launcher's stderr.
    Stderr(String),
    /// Nowhere now (dropped, or held for the cell's end).
    Held,
    /// Nowhere; the rank asked for a line of input, which only rank 0's user is asked for: it
    /// gets an empty line at once.
    AnswerEmpty,
}

/// One rank's lines of the running cell.
#[derive(Debug, Default)]
pub struct RankLines {
    rank: usize,
    /// Inside an evcxr block: whether it is the cell report (held, not passed).
    open_block: Option<bool>,
    /// The cell report's lines, held until every rank ended its cell.
    report: Vec<String>,
    /// Rank 0's stderr sync line, held likewise.
    sync: Option<String>,
    /// The rank printed evcxr's completion line.
    pub completed: bool,
    /// The rank's stderr reached its sync line.
    pub synced: bool,
    /// The rank's cell panicked.
    pub panicked: bool,
}

impl RankLines {
    /// A rank's lines, before its first cell.
    pub fn new(rank: usize) -> RankLines {
        RankLines {
            rank,
            ..Default::default()
        }
    }

    /// Forgets the last cell (keeps the rank).
    pub fn next_cell(&mut self) {
        *self = RankLines::new(self.rank);
    }

    /// Whether the rank is done with the cell: completed, and its stderr synced.
    pub fn done(&self) -> bool {
        self.completed && self.synced
    }

    fn labelled(&self, line: &str) -> String {
        format!("[rank {}] {line}", self.rank)
    }

    /// A protocol line: rank 0's is passed on, the others' dropped.
    fn rank_zero_only(&self, line: String) -> Routed {
        if self.rank == 0 {
            Routed::Stdout(line)
        } else {
            Routed::Held
        }
    }

    /// A line of the rank's stdout.
    pub fn stdout(&mut self, line: String) -> Routed {
        let first = self.rank == 0;
        if let Some(is_report) = self.open_block {
            if line == EVCXR_END_CONTENT || line == PANIC_NOTIFICATION {
                self.open_block = None;
            }
            if line == PANIC_NOTIFICATION {
                // evcxr ends a block at a panic too.
                self.panicked = true;
                return self.rank_zero_only(line);
            }
            return self.block_line(line, is_report);
        }
        if line == EXECUTION_COMPLETE {
            self.completed = true;
            return Routed::Held;
        }
        if line == PANIC_NOTIFICATION {
            self.panicked = true;
            return self.rank_zero_only(line);
        }
        if let Some(mime) = block_mime(&line) {
            let is_report = mime == CELL_REPORT_MIME;
            self.open_block = Some(is_report);
            return self.block_line(line, is_report);
        }
        if line.starts_with(MESSAGE_PREFIX) {
            if first {
                return Routed::Stdout(line);
            }
            return match CellMessage::from_line(&line) {
                Some(Ok(CellMessage::Panic {
                    thread,
                    message,
                    location,
                })) => Routed::Stdout(
                    CellMessage::Panic {
                        thread,
                        message: self.labelled(&message),
                        location,
                    }
                    .to_line(),
                ),
                _ => Routed::Held,
            };
        }
        if !first && line.starts_with(INPUT_REQUEST) {
            return Routed::AnswerEmpty;
        }
        if line.starts_with(EVCXR_PROTOCOL) {
            return self.rank_zero_only(line);
        }
        Routed::Stdout(self.labelled(&line))
    }

    /// A line of an evcxr block: a report's is held; rank 0's other blocks pass, the other
    /// ranks' are dropped.
    fn block_line(&mut self, line: String, is_report: bool) -> Routed {
        if is_report {
            self.report.push(line);
            Routed::Held
        } else {
            self.rank_zero_only(line)
        }
    }

    /// A line of the rank's stderr.
    pub fn stderr(&mut self, line: String) -> Routed {
        // Text the cell wrote without a final newline arrives glued to the sync line.
        let Some(at) = line.find(STDERR_SYNC_PREFIX) else {
            return Routed::Stderr(self.labelled(&line));
        };
        self.synced = true;
        if self.rank == 0 {
            self.sync = Some(line[at..].to_string());
        }
        if at == 0 {
            Routed::Held
        } else {
            Routed::Stderr(self.labelled(&line[..at]))
        }
    }

    /// The cell's report, if the rank sent one (taken: the next cell starts without).
    pub fn take_report(&mut self) -> Option<CellReport> {
        let report = std::mem::take(&mut self.report);
        serde_json::from_str(report.get(1)?).ok()
    }

    /// Rank 0's stderr sync line (taken), to write once every rank ended its cell.
    pub fn take_sync(&mut self) -> Option<String> {
        self.sync.take()
    }
}

/// A cell report as the block evcxr collects.
pub fn report_block(report: &CellReport) -> Vec<String> {
    vec![
        format!("{EVCXR_BEGIN_CONTENT} {CELL_REPORT_MIME}"),
        serde_json::to_string(report).unwrap_or_else(|_| "{}".into()),
        EVCXR_END_CONTENT.to_string(),
    ]
}

/// The MIME type of a line that opens an evcxr block.
fn block_mime(line: &str) -> Option<&str> {
    let at = line.find(EVCXR_BEGIN_CONTENT)?;
    line[at + EVCXR_BEGIN_CONTENT.len()..]
        .split_whitespace()
        .next()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(panicked: bool) -> CellReport {
        CellReport {
            sync_token: "1-1".into(),
            panicked,
            wall_seconds: 0.1,
            cuda_library: String::new(),
            memory: None,
            memory_missing: None,
            recording_seconds: 0.0,
            timeline: None,
            stopped: None,
            interrupt_seen: false,
            rank_memory: Vec::new(),
        }
    }

    fn report_lines(panicked: bool) -> Vec<String> {
        report_block(&report(panicked))
    }

    #[test]
    fn rank_zero_speaks_the_protocol_and_its_text_is_labelled() {
        let mut zero = RankLines::new(0);
        assert_eq!(
            zero.stdout("hello".into()),
            Routed::Stdout("[rank 0] hello".into())
        );
        let value = format!("{EVCXR_BEGIN_CONTENT} text/plain");
        assert_eq!(zero.stdout(value.clone()), Routed::Stdout(value));
        assert_eq!(zero.stdout("42".into()), Routed::Stdout("42".into()));
        assert_eq!(
            zero.stdout(EVCXR_END_CONTENT.into()),
            Routed::Stdout(EVCXR_END_CONTENT.into())
        );
        let live = format!("{MESSAGE_PREFIX}{{\"kind\":\"clear_output\",\"wait\":true}}");
        assert_eq!(zero.stdout(live.clone()), Routed::Stdout(live));
        for line in report_lines(false) {
            assert_eq!(zero.stdout(line), Routed::Held);
        }
        assert_eq!(
            zero.stderr("warning".into()),
            Routed::Stderr("[rank 0] warning".into())
        );
        assert_eq!(
            zero.stderr(format!("{STDERR_SYNC_PREFIX}1-1")),
            Routed::Held
        );
        assert!(!zero.done());
        assert_eq!(zero.stdout(EXECUTION_COMPLETE.into()), Routed::Held);
        assert!(zero.done() && !zero.panicked);
        assert_eq!(zero.take_report(), Some(report(false)));
        assert_eq!(zero.take_sync(), Some(format!("{STDERR_SYNC_PREFIX}1-1")));
    }

    #[test]
    fn other_ranks_keep_their_text_and_panics_and_drop_the_protocol() {
        let mut one = RankLines::new(1);
        assert_eq!(
            one.stdout("hi".into()),
            Routed::Stdout("[rank 1] hi".into())
        );
        for line in report_lines(false) {
            assert_eq!(one.stdout(line), Routed::Held);
        }
        assert_eq!(
            one.stdout("EVCXR_INPUT_REQUEST:name".into()),
            Routed::AnswerEmpty
        );
        assert_eq!(
            one.stdout("EVCXR_VARIABLE_CHANGED_TYPE:x".into()),
            Routed::Held
        );
        let panic = CellMessage::Panic {
            thread: "main".into(),
            message: "boom".into(),
            location: None,
        };
        let Routed::Stdout(line) = one.stdout(panic.to_line()) else {
            panic!("a panic is passed on")
        };
        let Some(Ok(CellMessage::Panic { message, .. })) = CellMessage::from_line(&line) else {
            panic!("{line}")
        };
        assert_eq!(message, "[rank 1] boom");
        assert_eq!(one.stdout(PANIC_NOTIFICATION.into()), Routed::Held);
        assert!(one.panicked);
        assert_eq!(
            one.stderr(format!("50%\r{STDERR_SYNC_PREFIX}9-1")),
            Routed::Stderr("[rank 1] 50%\r".into())
        );
        assert!(one.synced);
        assert_eq!(one.stdout(EXECUTION_COMPLETE.into()), Routed::Held);
        assert!(one.done());
        assert_eq!(one.take_report(), Some(report(false)));
        assert_eq!(one.take_sync(), None);
        one.next_cell();
        assert!(!one.done() && !one.panicked);
    }
}
