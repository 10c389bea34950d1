//! `%%memprofile` in the cells layer: the statement that starts recording (put on the cell's first
//! line of Rust, so that line numbers stay the cell's), where snapshots go, and the display made
//! from what the runtime captured.

use std::path::{Path, PathBuf};

use tchmem_wire::timeline::{TimelineCapture, TimelineRequest};
use tchmem_wire::Display;

use super::{cell_magic_reply, fail, Cells, Runner};
use crate::cell_syntax;
use crate::magics::memprofile::MemProfileRequest;
use crate::magics::optimize::OptimizeRequest;
use crate::magics::{self, CellMagic, CellMagicSource};
use crate::report;
use crate::session::{
    CellError, CellIo, CellOutcome, CellOutput, ErrorName, OutputSink, StreamName,
};
use crate::timeline::sites::CellSources;

/// Where a session's snapshots go: one directory per compile slot, emptied when a session
/// starts.
pub fn snapshot_dir(workdir: &Path) -> PathBuf {
    let dir = workdir.join("timelines");
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(error) = std::fs::create_dir_all(&dir) {
        tracing::warn!("could not create {}: {error}", dir.display());
    }
    dir
}

/// The runtime's request for a cell run.
fn request(profile: &MemProfileRequest, snapshot: &Path) -> TimelineRequest {
    TimelineRequest {
        snapshot: snapshot.display().to_string(),
        stacks: profile.stacks,
        max_entries: profile.max_entries,
        steps: profile.steps,
    }
}

/// `code` with the statement that starts recording at the start of its first line of Rust
/// (after evcxr's `:` commands, which must begin their lines).
fn with_recording(code: &str, request: &TimelineRequest) -> String {
    let json = serde_json::to_string(request).unwrap_or_default();
    let statement = format!("tchmem::timeline::begin_in_cell(r#\"{json}\"#); ");
    let mut out = String::with_capacity(code.len() + statement.len());
    let mut placed = false;
    for (i, line) in code.split('\n').enumerate() {
        if i > 0 {
            out.push('\n');
        }
        if !placed && !line.trim().is_empty() && !cell_syntax::is_before_rust(line) {
            out.push_str(&statement);
            placed = true;
        }
        out.push_str(line);
    }
    if !placed {
        out.push_str(&statement);
    }
    out
}

/// The display under a profiled cell; an explanation when there is no trace.
fn display(capture: &TimelineCapture, sources: &CellSources, run: usize) -> Display {
    let title = format!("allocation timeline of cell [{run}]");
    if let Some(why) = &capture.error {
        return report::text_display(format!(
            "%%memprofile recorded no timeline: {why}. The cell ran as usual, and its memory \
             record is kept."
        ));
    }
    match crate::timeline::load(capture) {
        Ok(timeline) => report::timeline::display(&timeline, capture, sources, &title),
        Err(error) => report::text_display(format!("%%memprofile: {error}")),
    }
}

/// What the cells layer keeps for allocation timelines.
pub(super) struct Timelines {
    /// Where snapshots are written.
    dir: PathBuf,
    /// `%memprofile timeline on`: a timeline for every later cell.
    pub every_cell: Option<MemProfileRequest>,
    /// The next cell's timeline (`%%memprofile`).
    next: Option<MemProfileRequest>,
    /// The last snapshot written (for `%memsnapshot`), or why the last profiled cell has none.
    last_snapshot: Option<Result<String, String>>,
    /// Code of every cell run, by execution count, as compiled (for stack frames).
    cells: Vec<(usize, String)>,
}

impl Timelines {
    /// Nothing recorded yet; snapshots go to `dir`.
    pub fn new(dir: PathBuf) -> Timelines {
        Timelines {
            dir,
            every_cell: None,
            next: None,
            last_snapshot: None,
            cells: Vec::new(),
        }
    }
}

impl<R: Runner> Cells<R> {
    /// `code` with recording started on its first line when this cell is to be profiled (once by
    /// `%%memprofile`, or every cell), and the request it records under; the code is kept to map
    /// stack frames back to cell lines.
    pub(super) fn with_timeline(&mut self, code: String) -> (String, Option<MemProfileRequest>) {
        self.timelines.cells.push((self.runs, code.clone()));
        let profile = self
            .timelines
            .next
            .take()
            .or_else(|| self.timelines.every_cell.clone())
            .filter(|_| self.runner.has_runtime());
        // Frames name cell lines only when the cell has line tables.
        self.runner
            .set_line_tables(profile.as_ref().is_some_and(|p| p.stacks));
        let Some(profile) = profile else {
            return (code, None);
        };
        let path = self
            .timelines
            .dir
            .join(format!("cell-{}.pickle", self.runs));
        (
            with_recording(&code, &request(&profile, &path)),
            Some(profile),
        )
    }

    pub(super) fn memprofile(
        &mut self,
        request: MemProfileRequest,
        source: &CellMagicSource<'_>,
        io: CellIo,
    ) -> CellOutcome {
        let magic_line = source.body_offset.saturating_sub(1);
        if let Some(inner) = magics::cell_magic(source.body) {
            let inner = CellMagicSource {
                body_offset: inner.body_offset + source.body_offset,
                ..inner
            };
            return match magics::parse_cell(&inner) {
                Ok(CellMagic::Optimize(optimize)) if optimize.compare.is_some() => {
                    fail(CellError::new(
                        ErrorName::MagicError,
                        "%%memprofile records one run; %%optimize --compare makes two. Profile \
                         the rewritten loop without --compare (or each version in its own cell)."
                            .to_string(),
                    ))
                }
                Ok(CellMagic::Optimize(OptimizeRequest { fit: Some(_), .. }))
                | Ok(CellMagic::Estimate(_))
                | Ok(CellMagic::Fit(_)) => fail(CellError::new(
                    ErrorName::MagicError,
                    "%%memprofile records one run; this magic runs the cell in several \
                         trials. Profile the loop it chooses in a cell of its own."
                        .to_string(),
                )),
                Ok(CellMagic::Optimize(optimize)) => {
                    self.timelines.next = Some(request);
                    let outcome = self.optimize(&optimize, &inner, io);
                    self.timelines.next = None;
                    outcome
                }
                Ok(CellMagic::Distributed(_)) => fail(CellError::new(
                    ErrorName::MagicError,
                    "%%memprofile records the notebook's own process; the ranks of a \
                     %%distributed cell are not recorded yet. Run the cell without %%memprofile."
                        .to_string(),
                )),
                Ok(CellMagic::MemProfile(_)) => fail(CellError::new(
                    ErrorName::MagicError,
                    "%%memprofile appears twice at the top of this cell; keep one.".to_string(),
                )),
                Err(reply) => cell_magic_reply(reply),
            };
        }
        self.timelines.next = Some(request);
        let padded = format!("{}{}", "\n".repeat(magic_line + 1), source.body);
        let outcome = self.run_as_the_cell(&padded, io);
        self.timelines.next = None;
        outcome
    }

    /// Draws the timeline the runtime captured around the cell that just ran, and writes its
    /// snapshot where `--snapshot` asked.
    pub(super) fn show_timeline(
        &mut self,
        profile: &MemProfileRequest,
        outcome: &CellOutcome,
        output: &OutputSink,
    ) {
        let capture = outcome.report.as_ref().and_then(|r| r.timeline.clone());
        let Some(capture) = capture else {
            if outcome.error.is_none() {
                output(CellOutput::Display(report::text_display(
                    "%%memprofile: the runtime returned no timeline for this cell (recording is \
                     off, or the cell did not reach its end)."
                        .to_string(),
                )));
            }
            return;
        };
        self.timelines.last_snapshot = Some(match &capture.error {
            None => Ok(capture.snapshot.clone()),
            Some(why) => Err(why.clone()),
        });
        let sources = CellSources::new(self.runner.generated_source(), &self.timelines.cells);
        output(CellOutput::Display(display(&capture, &sources, self.runs)));
        if let (Some(path), None) = (&profile.snapshot, &capture.error) {
            let said = match std::fs::copy(&capture.snapshot, path) {
                Ok(_) => format!("snapshot written to {path} (PyTorch's memory_viz opens it)\n"),
                Err(error) => format!("could not write the snapshot to {path}: {error}\n"),
            };
            output(CellOutput::Stream(StreamName::Stdout, said));
        }
    }

    /// `%memsnapshot PATH`: copies the last timeline's snapshot. After a profiled cell that
    /// could record none (no CUDA), it says so and writes nothing: not an error, the notebook
    /// goes on as it would on a GPU.
    pub(super) fn write_snapshot(&self, path: &str) -> Result<String, CellError> {
        let last = match &self.timelines.last_snapshot {
            None => {
                return Err(CellError::new(
                    ErrorName::MagicError,
                    "no cell has been profiled yet: run one under %%memprofile first (CUDA \
                     only), then %memsnapshot PATH.pickle writes its snapshot"
                        .to_string(),
                ))
            }
            Some(Err(why)) => {
                return Ok(format!(
                    "%memsnapshot: nothing written to {path}: the last %%memprofile cell \
                     recorded no timeline ({why})"
                ))
            }
            Some(Ok(last)) => last,
        };
        std::fs::copy(last, path)
            .map(|bytes| {
                format!(
                    "wrote {path} ({}): open it in PyTorch's memory_viz, or read it with \
                     torch.cuda._memory_viz",
                    report::format::human_bytes(bytes)
                )
            })
            .map_err(|error| {
                CellError::new(
                    ErrorName::MagicError,
                    format!("could not write {path}: {error}"),
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recording_starts_on_the_first_rust_line_and_lines_stay() {
        let request = TimelineRequest {
            snapshot: "/tmp/s.pickle".into(),
            stacks: false,
            max_entries: 10,
            steps: None,
        };
        let code = "\n:dep foo\nlet x = 1;\nlet y = 2;";
        let out = with_recording(code, &request);
        let lines: Vec<&str> = out.split('\n').collect();
        assert_eq!(lines.len(), 4);
        assert_eq!(lines[1], ":dep foo");
        assert!(lines[2].starts_with("tchmem::timeline::begin_in_cell(r#\"{"));
        assert!(lines[2].ends_with("let x = 1;"));
        assert!(lines[2].contains("\"max_entries\":10"));
    }
}
