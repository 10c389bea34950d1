//! A cell's code run and recorded: VarStores it makes watched, its timeline when one was asked
//! for, its memory record kept and shown (per `%memprofile`), an OOM explained.

use std::sync::Arc;

use tchmem_wire::memory::{Category, MemoryRecord};

use super::live::{self, LiveView};
use super::{auto_watch, binds, oom, Cells, Runner};
use crate::cell_error::ErrorName;
use crate::magics::ProfileMode;
use crate::report;
use crate::rewrite::earlier::EarlierCell;
use crate::session::{CellIo, CellOutcome, OutputSink};

impl<R: Runner> Cells<R> {
    /// Runs a cell's code and records its memory (shown per `%memprofile`).
    pub(super) fn run_cell_code(&mut self, code: &str, io: CellIo) -> CellOutcome {
        // Stores the cell visibly makes are watched inside it (no second compile).
        let (code, watched_in_cell) = if self.runner.has_runtime() {
            auto_watch::watch_where_made(code)
        } else {
            (code.to_string(), Vec::new())
        };
        let (code, profile) = self.with_timeline(code);
        let output = Arc::clone(&io.output);
        let mut outcome = self.run(&code, io);
        if let Some(profile) = &profile {
            self.show_timeline(profile, &outcome, &output);
        }
        if outcome.error.is_none() {
            self.auto_watched.extend(watched_in_cell.iter().cloned());
            if let Some(categories) = self.watch_new_var_stores(&code, &watched_in_cell) {
                // The cell's counters stay; the categories now count the new stores.
                if let Some(memory) = outcome.report.as_mut().and_then(|r| r.memory.as_mut()) {
                    memory.categories = categories;
                }
            }
        }
        self.record(&code, &mut outcome);
        outcome
    }

    /// Runs `code` as the notebook's cell (the user's, or what a magic runs in its place), and
    /// keeps it for later magics to follow names back to when it compiled (see
    /// `rewrite::earlier`). Trials and compare runs use [`Self::run_cell_code`]: their code
    /// defines nothing that lives on.
    pub(super) fn run_as_the_cell(&mut self, code: &str, io: CellIo) -> CellOutcome {
        let outcome = self.run_cell_code(code, io);
        let compiled = outcome
            .error
            .as_ref()
            .is_none_or(|error| error.ename != ErrorName::CompilationError);
        if compiled && !code.trim().is_empty() {
            self.history.push(EarlierCell {
                run: self.runs,
                code: code.to_string(),
            });
        }
        outcome
    }

    /// Output for a run whose own output is dropped (a trial): only its live view, shown under
    /// the running cell.
    pub(super) fn live_view_only(&self) -> CellIo {
        let output: OutputSink = match &self.cell_output {
            Some(cell) => {
                let cell = Arc::clone(cell);
                Arc::new(move |out| {
                    if live::is_live_view(&out) {
                        cell(out);
                    }
                })
            }
            None => Arc::new(|_| {}),
        };
        CellIo {
            output,
            input: None,
        }
    }

    /// Runs code on the runner, noticing when its process was replaced (a new process holds
    /// nothing that was watched).
    pub(super) fn run(&mut self, code: &str, io: CellIo) -> CellOutcome {
        let (view, output) = LiveView::wrap(io.output, self.live_label.clone());
        let outcome = self.runner.run(
            code,
            CellIo {
                output,
                input: io.input,
            },
        );
        view.finish();
        if self.runner.process_generation() != self.watched_generation {
            self.auto_watched.clear();
            self.watched_generation = self.runner.process_generation();
        }
        outcome
    }

    /// Keeps the cell's memory record and decides whether it is shown; an error that was an OOM
    /// becomes one that says so.
    fn record(&mut self, code: &str, outcome: &mut CellOutcome) {
        let record = outcome.report.as_ref().and_then(|report| {
            let mut record = report.memory.clone()?;
            record.recording_seconds = Some(report.recording_seconds);
            record.wall_seconds = Some(report.wall_seconds);
            Some(record)
        });
        if let Some(error) = outcome.error.take() {
            // Without a record (recording off, no runtime) libtorch's message can still tell.
            let none = MemoryRecord::default();
            outcome.error = Some(oom::out_of_memory(
                error,
                record.as_ref().unwrap_or(&none),
                &oom::failed_cell(code),
            ));
        }
        if let Some(record) = record {
            let show = match self.profile_mode {
                ProfileMode::Always => true,
                ProfileMode::Auto => report::changed(&record, self.records.last().map(|(_, r)| r)),
                ProfileMode::Off => false,
            };
            if show {
                outcome.memory_display = Some(report::cell_display(&record));
            }
            self.records.push((self.runs, record));
        }
    }

    /// Watches VarStores the user's variables hold that are not watched yet, or that `code` just
    /// bound anew (the user need not call `tchmem::watch`), but for those `code` watched itself.
    /// Returns the categories measured after watching them, if any were.
    fn watch_new_var_stores(
        &mut self,
        code: &str,
        watched_in_cell: &[String],
    ) -> Option<Vec<Category>> {
        if !self.runner.has_runtime() {
            return None; // nothing to watch with
        }
        let new: Vec<String> = self
            .runner
            .variables()
            .into_iter()
            .filter(|(_, ty)| ty.rsplit("::").next() == Some("VarStore"))
            .map(|(name, _)| name)
            .filter(|name| !self.auto_watched.contains(name) || binds(code, name))
            .filter(|name| !watched_in_cell.contains(name))
            .collect();
        if new.is_empty() {
            return None;
        }
        let code: String = new
            .iter()
            .map(|name| format!("tchmem::watch(&{name});\n"))
            .collect();
        self.auto_watched.extend(new);
        let outcome = self.run(&code, CellIo::quiet());
        if let Some(error) = &outcome.error {
            tracing::debug!("could not watch a VarStore: {}", error.evalue);
            return None;
        }
        outcome.report?.memory.map(|record| record.categories)
    }
}
