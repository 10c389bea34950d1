//! What a cell means: its magics dispatched, its code run through a [`Runner`] and its memory
//! recorded, timelines, `%%optimize` and the "will it fit?" trials orchestrated. Generic over
//! the runner, so all of it is tested over a fake one (see `tests`); knows nothing of evcxr.

mod auto_watch;
mod distributed;
mod estimate_model;
mod fit;
pub mod live;
mod memprofile;
mod oom;
mod op_replay;
mod optimize;
mod optimize_fit;
mod run;
mod study;
#[cfg(test)]
mod tests;
mod trial;

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use crate::session::Runner;
pub use memprofile::snapshot_dir;

use crate::cell_syntax;
use crate::magics::{self, CellMagic, Magic, MagicReply, ProfileMode};
use crate::report;
use crate::rewrite::earlier::{Assembled, EarlierCell, LibraryModule, Wanted};
use crate::rewrite::{self};
use crate::session::{
    CellError, CellIo, CellOutcome, CellOutput, ErrorName, OutputSink, StreamName,
};
use memprofile::Timelines;
use tchmem_wire::memory::MemoryRecord;

/// The notebook's side of a session: what it remembers between cells, over a runner.
pub struct Cells<R> {
    runner: R,
    /// When memory summaries are shown (`%memprofile`).
    profile_mode: ProfileMode,
    /// Memory records of every cell so far, numbered by run.
    records: Vec<(usize, MemoryRecord)>,
    /// Cells run so far (magic-only cells included).
    runs: usize,
    /// Variables holding a VarStore that the session already watches for the user.
    auto_watched: HashSet<String>,
    /// The runner's process generation `auto_watched` belongs to.
    watched_generation: u64,
    /// Timelines (`%%memprofile`, `%memprofile timeline on`).
    timelines: Timelines,
    /// The last cell with a training step that ran (failed ones too): what `%memestimate` and
    /// `%memfit` act on when they are alone in their cell.
    last_training_cell: Option<(usize, String)>,
    /// The code of every cell that compiled, in order: where magics follow a name back to the
    /// cell that defined it.
    history: Vec<EarlierCell>,
    /// Which run of a magic the next runs are, for their live view (`None`: the cell itself).
    live_label: Option<String>,
    /// Where the running cell's output goes, while it runs: trials, whose own output is dropped,
    /// show their live view there.
    cell_output: Option<OutputSink>,
    /// The ranks that run `%%distributed` cells, once one ran.
    world: Option<distributed::World<R>>,
}

/// The module `module` (`tch::vision::resnet`) of a dependency of the cells, read from the
/// sources the runner knows for it (`src/vision/resnet.rs` or `src/vision/resnet/mod.rs`).
fn library_module(runner: &impl Runner, module: &[String]) -> Option<LibraryModule> {
    let (krate, inner) = module.split_first()?;
    // The standard library's modules build no models (and are not cargo's to find).
    if inner.is_empty() || ["std", "core", "alloc"].contains(&krate.as_str()) {
        return None;
    }
    let source = runner.dependency_source(krate)?;
    let relative = inner.join("/");
    let found = [format!("{relative}.rs"), format!("{relative}/mod.rs")]
        .into_iter()
        .find_map(|file| {
            let path = source.join(&file);
            let code = std::fs::read_to_string(&path).ok()?;
            // Named from the package's folder (`tch-0.24.0/src/vision/resnet.rs`).
            let package = source.parent().and_then(|p| p.file_name());
            let shown = package.map_or(path.clone(), |p| Path::new(p).join("src").join(&file));
            Some(LibraryModule {
                file: shown.display().to_string(),
                code,
            })
        });
    if found.is_none() {
        tracing::info!(
            "no source file of {} under {}",
            module.join("::"),
            source.display()
        );
    }
    found
}

/// Where a report's displays go: the cell's output.
fn display_sink(output: &OutputSink) -> report::fit::ShowDisplay {
    let output = Arc::clone(output);
    Arc::new(move |display| output(CellOutput::Display(display)))
}

/// A failed cell.
fn fail(error: CellError) -> CellOutcome {
    CellOutcome {
        error: Some(error),
        ..Default::default()
    }
}

/// Whether `code` has a `let` binding of `name` (so the variable may hold a new value).
fn binds(code: &str, name: &str) -> bool {
    code.split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .filter(|word| !word.is_empty())
        .collect::<Vec<_>>()
        .windows(3)
        .any(|w| w[0] == "let" && (w[1] == name || (w[1] == "mut" && w[2] == name)))
}

/// A magic's help (added to `help`, for the pager) or mistake (the cell's `MagicError`).
fn magic_reply(reply: MagicReply, help: &mut Vec<String>) -> Result<(), CellError> {
    match reply {
        MagicReply::Help(text) => {
            help.push(text);
            Ok(())
        }
        MagicReply::Error(message) => Err(CellError::new(ErrorName::MagicError, message)),
    }
}

/// The outcome of a cell whose cell magic's line did not parse: its help in the pager, or its
/// mistake as the cell's error.
fn cell_magic_reply(reply: MagicReply) -> CellOutcome {
    let mut help = Vec::new();
    CellOutcome {
        error: magic_reply(reply, &mut help).err(),
        page: help_page(help),
        ..Default::default()
    }
}

/// Help texts as a pager bundle (none when there are none).
fn help_page(help: Vec<String>) -> BTreeMap<String, String> {
    if help.is_empty() {
        return Default::default();
    }
    let text = help
        .iter()
        .map(|text| text.trim_end())
        .collect::<Vec<_>>()
        .join("\n\n");
    [("text/plain".to_string(), text + "\n")].into()
}

fn mode_name(mode: ProfileMode) -> &'static str {
    match mode {
        ProfileMode::Auto => "auto (after cells that changed memory)",
        ProfileMode::Always => "always",
        ProfileMode::Off => "off",
    }
}

impl<R: Runner> Cells<R> {
    /// The cells layer over `runner`; snapshots of timelines go to `snapshot_dir`.
    pub fn new(runner: R, snapshot_dir: PathBuf) -> Cells<R> {
        Cells {
            runner,
            profile_mode: ProfileMode::default(),
            records: Vec::new(),
            runs: 0,
            auto_watched: HashSet::new(),
            watched_generation: 0,
            timelines: Timelines::new(snapshot_dir),
            last_training_cell: None,
            history: Vec::new(),
            live_label: None,
            cell_output: None,
            world: None,
        }
    }

    /// The runner, for what needs no cell meaning (completion, inspection).
    pub fn runner_mut(&mut self) -> &mut R {
        &mut self.runner
    }

    /// `code` (this cell's) with what `wanted` from the cells that ran before in front of it.
    fn assemble(&self, code: &str, wanted: Wanted) -> Assembled {
        self.assemble_as(code, self.runs, wanted)
    }

    /// `code`, the code of cell number `run` (a magic alone acts on the last training cell's),
    /// with what `wanted` from the cells that ran before in front of it.
    fn assemble_as(&self, code: &str, run: usize, wanted: Wanted) -> Assembled {
        let sources = |module: &[String]| library_module(&self.runner, module);
        rewrite::earlier::assemble_with(code, run, &self.history, wanted, &sources)
    }

    /// Runs one cell: its magics, then its code, then records its memory.
    pub fn execute(&mut self, cell: &str, io: CellIo) -> CellOutcome {
        self.runs += 1;
        self.cell_output = Some(Arc::clone(&io.output));
        let outcome = self.execute_cell(cell, io);
        self.cell_output = None;
        outcome
    }

    fn execute_cell(&mut self, cell: &str, io: CellIo) -> CellOutcome {
        let mut help = Vec::new();
        if let Some(source) = magics::cell_magic(cell) {
            return match magics::parse_cell(&source) {
                Ok(CellMagic::Optimize(request)) => self.optimize(&request, &source, io),
                Ok(CellMagic::MemProfile(request)) => self.memprofile(request, &source, io),
                Ok(CellMagic::Estimate(request)) => self.memestimate(&request, &source, io),
                Ok(CellMagic::Fit(args)) => self.memfit(&args, &source, io),
                Ok(CellMagic::Distributed(request)) => self.distributed(&request, &source, io),
                Err(reply) => cell_magic_reply(reply),
            };
        }
        let (magic_lines, code) = magics::split(cell);
        for line in magic_lines {
            if let Err(error) = self.apply_magic(line, &io, &mut help) {
                return fail(error);
            }
        }
        // The magic lines become blank lines, so the lines compile errors name are the cell's.
        let skipped = cell[..cell.len() - code.len()].matches('\n').count();
        // `:opt` and `:edition` set how the cells' own code is built (see session/cell_build).
        let (code, said) = self.runner.take_commands(code);
        for answer in said {
            match answer {
                Ok(text) => (io.output)(CellOutput::Stream(StreamName::Stdout, text + "\n")),
                Err(why) => return fail(CellError::new(ErrorName::CommandError, why)),
            }
        }
        let code = code.as_str();
        // A cheap test first: every training step the rewriter knows calls `backward`.
        if code.contains("backward") && rewrite::training_facts(code).trains {
            self.last_training_cell = Some((self.runs, code.to_string()));
        }
        let mut outcome = if code.trim().is_empty() {
            CellOutcome::default()
        } else {
            let padded = format!("{}{code}", "\n".repeat(skipped));
            let output = Arc::clone(&io.output);
            let mut outcome = self.run_as_the_cell(&padded, io);
            // A training cell that ran out of CUDA memory: measure what would fit.
            if let Some(error) = outcome.error.as_mut() {
                if error.ename == ErrorName::OutOfMemory && code.contains("backward") {
                    if let Some(fixes) = self.measured_oom_fixes(code, &output) {
                        error.evalue.push_str(&fixes);
                    }
                }
            }
            outcome
        };
        if cell_syntax::is_help_command(code) && outcome.error.is_none() {
            outcome.page = std::mem::take(&mut outcome.data);
        }
        if !help.is_empty() {
            // A magic's --help above `:help`: both texts, the magic's first.
            if let Some(text) = outcome.page.remove("text/plain") {
                help.push(text);
            }
            outcome.page.extend(help_page(help));
        }
        outcome
    }

    /// Applies a line magic (`%memprofile on`, `%memhistory`, …), showing what it says.
    fn apply_magic(
        &mut self,
        line: &str,
        io: &CellIo,
        help: &mut Vec<String>,
    ) -> Result<(), CellError> {
        let show = |text: String| {
            (io.output)(CellOutput::Stream(StreamName::Stdout, text + "\n"));
        };
        match magics::parse(line) {
            Ok(Magic::Profile(Some(mode))) => {
                self.profile_mode = mode;
                show(format!("memory summaries: {}", mode_name(mode)));
            }
            Ok(Magic::Profile(None)) => show(format!(
                "memory summaries: {}",
                mode_name(self.profile_mode)
            )),
            Ok(Magic::Timeline(on)) => {
                self.timelines.every_cell =
                    on.then(|| magics::memprofile::parse_args(&[]).expect("the defaults parse"));
                show(if on {
                    "allocation timelines: every later cell (%memprofile timeline off stops)".into()
                } else {
                    "allocation timelines: off (%%memprofile still records one cell)".into()
                });
            }
            Ok(Magic::Snapshot(path)) => show(self.write_snapshot(&path)?),
            Ok(Magic::History) => {
                (io.output)(CellOutput::Display(report::history_display(&self.records)));
            }
            Ok(Magic::Summary) => {
                let last = self.records.last().map(|(run, record)| (*run, record));
                (io.output)(CellOutput::Display(report::summary_display(last)));
            }
            Ok(Magic::Free) => show(self.memfree()?),
            Err(reply) => return magic_reply(reply, help),
        }
        Ok(())
    }
}
