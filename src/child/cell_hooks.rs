//! Native code run before and after every cell, in the child, at no compile cost.

use std::time::Instant;

use super::live::LiveSampler;
use super::runtime_slot;
use super::stdout_tap::StdoutTap;
use crate::libtorch::CudaLibrary;
use tchmem_wire::{CellReport, CELL_REPORT_MIME, STDERR_SYNC_PREFIX};

/// State kept between the hooks of one child process.
pub struct CellHooks {
    tap: StdoutTap,
    live: LiveSampler,
    cuda: CudaLibrary,
    cells_run: u64,
    started: Instant,
    /// Time spent in the runtime's before-cell hook of the running cell.
    recording_before: f64,
}

impl CellHooks {
    /// Hooks that report through `tap`.
    pub fn new(tap: StdoutTap) -> Self {
        let live = LiveSampler::start(tap.writer(), runtime_slot::run_state());
        Self {
            tap,
            live,
            cuda: CudaLibrary::Absent("not loaded yet (evcxr's warm-up)".into()),
            cells_run: 0,
            started: Instant::now(),
            recording_before: 0.0,
        }
    }

    /// What became of libtorch_cuda, for the next reports.
    pub fn set_cuda_library(&mut self, cuda: CudaLibrary) {
        self.cuda = cuda;
    }

    /// Runs just before the cell's code.
    pub fn before_cell(&mut self) {
        let start = Instant::now();
        if runtime_slot::recording_enabled() {
            runtime_slot::before_cell();
        }
        runtime_slot::run_state().begin_run();
        self.started = Instant::now();
        self.recording_before = (self.started - start).as_secs_f64();
        self.live.cell_started();
    }

    /// Runs just after the cell's code returned (also after a caught panic): sends the cell's
    /// report as a rich-output block that evcxr hands to the engine with the cell's outputs, and
    /// marks the end of the cell's stderr.
    pub fn after_cell(&mut self) {
        let wall_seconds = self.started.elapsed().as_secs_f64();
        self.live.cell_ended();
        let (stopped, interrupt_seen) = runtime_slot::run_state().end_run();
        let start = Instant::now();
        let after = if runtime_slot::recording_enabled() {
            runtime_slot::after_cell()
        } else {
            Some(Err(format!(
                "recording is off ({}=0)",
                runtime_slot::RECORD_ENV
            )))
        };
        let recording_seconds = self.recording_before + start.elapsed().as_secs_f64();
        let (memory, timeline, memory_missing) = match after {
            Some(Ok(after)) => (Some(after.record), after.timeline, None),
            Some(Err(why)) => (None, None, Some(why)),
            None => (
                None,
                None,
                Some("the tchmem runtime is not loaded (no tch in this kernel)".into()),
            ),
        };
        let panicked = self.tap.sync();
        self.cells_run += 1;
        let report = CellReport {
            sync_token: format!("{}-{}", std::process::id(), self.cells_run),
            panicked,
            wall_seconds,
            cuda_library: self.cuda.describe(),
            memory,
            memory_missing,
            recording_seconds,
            timeline,
            stopped,
            interrupt_seen,
            rank_memory: Vec::new(),
        };
        let json = serde_json::to_string(&report).unwrap_or_else(|_| "{}".into());
        let begin = format!("EVCXR_BEGIN_CONTENT {CELL_REPORT_MIME}");
        self.tap.write_lines(&[&begin, &json, "EVCXR_END_CONTENT"]);
        eprintln!("{STDERR_SYNC_PREFIX}{}", report.sync_token);
    }

    /// Whether the next cell's evcxr rich output passes unchanged (see
    /// [`StdoutTap::keep_blocks`]).
    pub fn keep_evcxr_blocks(&self, keep: bool) {
        self.tap.keep_blocks(keep);
    }

    /// Writes a protocol line to the kernel.
    pub fn write_line(&self, line: &str) {
        self.tap.write_lines(&[line]);
    }
}
