//! `%%memprofile` in the engine: the statement that starts recording (put on the cell's first
//! line of Rust, so that line numbers stay the cell's), where snapshots go, and the display made
//! from what the runtime captured.

use std::path::{Path, PathBuf};

use tchmem_wire::timeline::{TimelineCapture, TimelineRequest};
use tchmem_wire::Display;

use crate::cell_syntax;
use crate::magics::memprofile::MemProfileRequest;
use crate::report;
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
pub fn request(profile: &MemProfileRequest, snapshot: &Path) -> TimelineRequest {
    TimelineRequest {
        snapshot: snapshot.display().to_string(),
        stacks: profile.stacks,
        max_entries: profile.max_entries,
        steps: profile.steps,
    }
}

/// `code` with the statement that starts recording at the start of its first line of Rust
/// (after evcxr's `:` commands, which must begin their lines).
pub fn with_recording(code: &str, request: &TimelineRequest) -> String {
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

/// The generated crate's source (for mapping stack frames to cells), read right after the cell.
pub fn generated_source(workdir: &Path) -> Vec<String> {
    std::fs::read_to_string(workdir.join("src").join("lib.rs"))
        .map(|text| text.lines().map(str::to_string).collect())
        .unwrap_or_default()
}

/// The display under a profiled cell; an explanation when there is no trace.
pub fn display(capture: &TimelineCapture, sources: &CellSources, run: usize) -> Display {
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
