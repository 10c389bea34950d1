//! The evcxr half of a session: owns evcxr's context and the process that runs cells, compiles
//! and runs code, and answers completion and inspection. It knows no magic: what a cell means
//! (magics, records, rewrites) is the `cells` layer's, which drives it through [`Runner`].

mod analysis_std;
mod cell_build;
mod closures;
mod completion;
mod context;
pub mod control;
mod dependency_sources;
pub mod errors;
mod infer;
mod keep;
pub mod loop_checks;
mod offline;
mod opaque;
mod outcome;
pub mod path_completions;
mod positions;
mod rich;
mod runner;
mod streams;
mod top_let;
pub mod workdir;

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use evcxr::{CommandContext, EvalCallbacks};

pub use completion::metadata as completion_metadata;
pub use context::{EngineConfig, TCH_VERSION};
pub use control::{grace as interrupt_grace, Control};
pub use errors::{CellError, ErrorName};
pub use outcome::{CellIo, CellOutcome, CompletionOutcome, InputFn, InspectOutcome};
pub use path_completions::PathCompletions;
pub use runner::Runner;
pub use streams::{CellOutput, OutputSink, StreamName};

use context::create_context;
use errors::Termination;
use offline::{needs_the_network, OFFLINE_OFF, OFFLINE_ON};
use positions::char_to_byte;
use streams::StreamPump;
use tchmem_wire::{CellReport, CELL_REPORT_MIME};

use crate::cell_syntax::{self, Syntax, Tail};

/// The file in a compile directory that says its dependencies were checked (see
/// `Session::check_dependencies`).
const DEPENDENCIES_CHECKED: &str = "tchmem-dependencies-checked";

/// How long to wait for the end of a cell's stderr after the cell returned.
const STDERR_GRACE: Duration = Duration::from_secs(5);

/// The evcxr context and what goes with it.
pub struct Session {
    context: Option<(CommandContext, StreamPump)>,
    /// Told to the user with the next cell's output (tch missing, prelude failed, …).
    notices: Vec<String>,
    /// Why the context could not be created; every cell reports it.
    fatal: Option<String>,
    /// Code that sets up a fresh child process (installs the runtime's panic hook); re-run after
    /// the child was restarted.
    child_setup: Option<String>,
    /// The child was restarted (crash, interrupt) and has not been set up again.
    child_restarted: bool,
    /// How many times a new child replaced the old one (see [`Runner::process_generation`]).
    generation: u64,
    /// The compile directory (its generated `src/lib.rs` maps stacks to cells).
    workdir: std::path::PathBuf,
    /// How the cells' own code is built (`:opt`, `:edition`); `None` when its file could not be
    /// written (cells then keep evcxr's level, and are read as edition 2021).
    cell_build: Option<cell_build::CellBuild>,
    control: Arc<Control>,
    /// How this session was set up (a `%%distributed` world is set up from it).
    config: EngineConfig,
    /// Where the cells' dependencies keep their sources, as asked so far.
    dependency_sources: dependency_sources::DependencySources,
}

impl Session {
    /// Creates the context and compiles the prelude.
    pub fn start(config: EngineConfig, control: Arc<Control>) -> Session {
        let started = Instant::now();
        let mut session = Session {
            context: None,
            notices: Vec::new(),
            fatal: None,
            child_setup: None,
            child_restarted: false,
            generation: 0,
            workdir: config.workdir.clone(),
            cell_build: None,
            control,
            config: config.clone(),
            dependency_sources: Default::default(),
        };
        match create_context(&config) {
            Ok((context, outputs)) => {
                session.control.set_child(context.process_handle());
                let pump = StreamPump::start(outputs.stdout, outputs.stderr);
                session.context = Some((context, pump));
                tracing::info!(
                    "start: evcxr's context and the child after {:.2} s",
                    started.elapsed().as_secs_f64()
                );
                session.cell_build = cell_build::CellBuild::start(&config.workdir)
                    .inspect_err(|error| {
                        tracing::warn!("cells keep evcxr's optimisation level and edition: {error}")
                    })
                    .ok();
            }
            Err(error) => {
                tracing::error!("{error:#}");
                session.fatal = Some(format!("{error:#}"));
                return session;
            }
        }
        for problem in [&config.libtorch_problem, &config.runtime_problem]
            .into_iter()
            .flatten()
        {
            session
                .notices
                .push(format!("tch is not available in this kernel: {problem}"));
        }
        if let Some(prelude) = config.prelude() {
            tracing::info!("compiling the prelude (tch {})", TCH_VERSION);
            let outcome = session.run_prelude(&prelude);
            tracing::info!(
                "start: the prelude compiled and ran after {:.2} s",
                started.elapsed().as_secs_f64()
            );
            if outcome.error.is_none() {
                session.child_setup = Some(config.child_setup());
                session
                    .control
                    .boundaries
                    .store(loop_checks::enabled(), Ordering::SeqCst);
                session.check_dependencies(&config.workdir, &prelude);
            }
            if let Some(error) = outcome.error {
                // The traceback, where there is one, already begins with the error's value.
                let why = if error.traceback.is_empty() {
                    error.evalue
                } else {
                    error.traceback.join("\n")
                };
                session
                    .notices
                    .push(format!("tch could not be added to this kernel:\n{why}"));
            }
        }
        tracing::info!("engine ready in {:.1} s", started.elapsed().as_secs_f64());
        session
    }

    /// Whether the prelude (tch and the runtime) compiled and loaded.
    pub fn prelude_loaded(&self) -> bool {
        self.fatal.is_none() && self.child_setup.is_some()
    }

    /// Has `cargo check` build the dependencies' metadata now. evcxr answers a cell whose
    /// variable types its analysis cannot tell (`let c = a + y;` with `y` undefined) with `cargo
    /// check`, and the first check in a compile directory checks every dependency, tch included:
    /// the user's first such compile error came back after 83 s (2 shared cores). Done once per
    /// compile directory and prelude (36 s in a fresh one); a marker file in the directory,
    /// holding the prelude that was checked, spares later starts the 0.4 s of a repeated check.
    fn check_dependencies(&mut self, workdir: &Path, prelude: &str) {
        let marker = workdir.join(DEPENDENCIES_CHECKED);
        if std::fs::read_to_string(&marker).is_ok_and(|checked| checked == prelude) {
            return;
        }
        let Some((context, _)) = self.context.as_mut() else {
            return;
        };
        let started = Instant::now();
        match context.check("") {
            Ok(_) => {
                if let Err(error) = std::fs::write(&marker, prelude) {
                    tracing::warn!("could not write {}: {error}", marker.display());
                }
            }
            Err(error) => tracing::warn!("could not check the dependencies: {error}"),
        }
        tracing::info!(
            "dependencies checked in {:.1} s",
            started.elapsed().as_secs_f64()
        );
    }

    /// Runs the prelude with cargo offline, then goes back online for the user's cells.
    ///
    /// evcxr checks each `:dep` line with `cargo metadata`, which online asks the registry
    /// about every dependency it has to resolve: 0.4-0.5 s a line on this project's machine
    /// (results/startup-cpu.txt), for crates that set-up put in cargo's cache and the slot's
    /// lock. Where the cache lacks one (a start with no set-up, a cleaned cache), cargo says
    /// so, and the prelude runs again online.
    fn run_prelude(&mut self, prelude: &str) -> CellOutcome {
        let io = || CellIo {
            output: Arc::new(|output| tracing::debug!("prelude: {output:?}")),
            input: None,
        };
        let offline = self.run_code(&format!("{OFFLINE_ON}\n{prelude}"), io());
        self.back_online();
        match &offline.error {
            Some(error) if needs_the_network(error) => {
                tracing::info!("the prelude needs crates cargo has not cached; running it online");
                self.run_code(prelude, io())
            }
            _ => offline,
        }
    }

    /// Cargo online again: in evcxr's settings and in the slot's cargo configuration, which
    /// evcxr would otherwise leave offline until the next compile.
    fn back_online(&mut self) {
        if let Some((context, _)) = self.context.as_mut() {
            if let Err(error) = context.execute(OFFLINE_OFF) {
                tracing::warn!("cargo stays offline for this session's `:dep` lines: {error}");
            }
        }
        if let Err(error) = offline::write_online(&self.workdir) {
            tracing::warn!("cargo may check the first `:dep` line offline: {error}");
        }
    }

    /// Runs Rust code (and evcxr commands) in the context.
    fn run_code(&mut self, code: &str, io: CellIo) -> CellOutcome {
        self.set_up_restarted_child();
        for notice in self.notices.drain(..) {
            (io.output)(CellOutput::Stream(
                StreamName::Stderr,
                format!("{notice}\n"),
            ));
        }
        let Some((context, pump)) = self.context.as_mut() else {
            let why = self.fatal.clone().unwrap_or_default();
            return CellOutcome {
                error: Some(CellError::new(ErrorName::KernelNotReady, why)),
                ..Default::default()
            };
        };
        // Cells read as edition 2021 unless the user said otherwise (see crate::cell_edition).
        let rewritten = match &self.cell_build {
            Some(build) if build.edition_2024() => None,
            _ => crate::cell_edition::as_2021(code),
        };
        let code = rewritten.as_deref().unwrap_or(code);
        // Loop boundaries where an interrupt stops the cell (see loop_checks).
        let checked = (self.child_setup.is_some() && loop_checks::enabled())
            .then(|| loop_checks::insert(code))
            .flatten();
        let ends_in_value = !matches!(
            cell_syntax::read(code),
            Syntax::Valid(Tail::Statement | Tail::Unit)
        );
        pump.attach(Arc::clone(&io.output), ends_in_value);
        let input = io.input;
        let mut callbacks = EvalCallbacks {
            input_reader: &move |request| match &input {
                Some(ask) => ask(&request.prompt, request.is_password),
                None => String::new(),
            },
        };
        // The interrupt goes to this session's child (a world's cells run in another one).
        self.control.set_child(context.process_handle());
        let child_before = self.control.child_pid();
        self.control.set_running(true);
        let started = Instant::now();
        let mut compiled = std::borrow::Cow::Borrowed(checked.as_deref().unwrap_or(code));
        let mut result = context.execute_with_callbacks(&compiled, &mut callbacks);
        if checked.is_some() && failed_on_a_check(&result) {
            tracing::warn!("a loop check did not compile; the cell runs without them");
            compiled = code.into();
            result = context.execute_with_callbacks(code, &mut callbacks);
        }
        tracing::debug!("evcxr compiled and ran the cell in {:?}", started.elapsed());
        // The code compile errors point into: the cell, or the cell with types written out.
        let (result, compiled) =
            keep::keep_variables(context, code, compiled, result, &mut callbacks, &io.output);
        self.control.set_running(false);
        // A crash, an interrupt, or evcxr's :restart / :clear: a new child needs setting up.
        if self.control.child_pid() != child_before {
            self.child_restarted = true;
            self.generation += 1;
        }
        let interrupted = self
            .control
            .interrupt_requested
            .swap(false, Ordering::SeqCst);
        if interrupted {
            self.control.forget_request();
        }

        let mut outcome = CellOutcome::default();
        let mut timing = None;
        let mut failed_to_compile = false;
        match result {
            Ok(outputs) => {
                // What evcxr collected: the child's report and the output of `:` commands (the
                // cell's own rich output comes through the pump).
                let mut data = outputs.content_by_mime_type;
                outcome.report = data
                    .remove(CELL_REPORT_MIME)
                    .and_then(|json| serde_json::from_str::<CellReport>(&json).ok());
                outcome.data = data.into_iter().collect();
                timing = outputs.timing;
                for phase in &outputs.phases {
                    tracing::debug!("evcxr phase {}: {:?}", phase.name, phase.duration);
                }
            }
            Err(error) => {
                let termination = if interrupted {
                    Termination::Interrupted(self.control.stop_reason())
                } else {
                    Termination::Crashed
                };
                failed_to_compile = matches!(error, evcxr::Error::CompilationErrors(_));
                // Shown as the user wrote it: the checks out, columns moved back.
                let shown = loop_checks::strip(&compiled);
                let to_cell = |at| loop_checks::user_position(&compiled, at);
                outcome.error = Some(errors::from_evcxr(error, &shown, termination, &to_cell));
            }
        }
        let took = timing.map(|timing| format!("Took {}ms\n", timing.as_millis()));
        settle_output(pump, &mut outcome, &io.output, took.as_deref());
        if interrupted && outcome.error.is_none() {
            let note = if outcome.report.as_ref().is_some_and(|r| r.interrupt_seen) {
                "tchmem: the cell saw the interrupt (tchmem::interrupted()) and ended by itself; \
                 variables kept\n"
            } else {
                "tchmem: the cell ended before it reached a loop boundary, so it ran to the end\n"
            };
            (io.output)(CellOutput::Stream(StreamName::Stderr, note.into()));
        }
        if let (true, Some(error)) = (failed_to_compile, outcome.error.as_mut()) {
            keep_uses(context, code, error);
        }
        tracing::debug!(
            "the cell's output was drained {:?} after it began",
            started.elapsed()
        );
        outcome
    }

    /// After evcxr's `:restart`, a crash or an interrupt: the new child gets the runtime's set-up.
    fn set_up_restarted_child(&mut self) {
        if !std::mem::take(&mut self.child_restarted) {
            return;
        }
        let Some(setup) = self.child_setup.clone() else {
            return;
        };
        // The first cell after evcxr's :restart can take the new child down again (evcxr still
        // expects the old variables); evcxr then starts a clean one, so one more try.
        for attempt in 1..=2 {
            let outcome = self.run_code(&setup, CellIo::quiet());
            match outcome.error {
                None => break,
                Some(error) => tracing::warn!(
                    "could not set up the restarted child (attempt {attempt}): {}",
                    error.evalue
                ),
            }
        }
        self.child_restarted = false;
    }
    /// Completions at a character cursor.
    pub fn complete(&mut self, code: &str, cursor: usize) -> CompletionOutcome {
        let Some((context, _)) = self.context.as_mut() else {
            return CompletionOutcome::default();
        };
        let byte = char_to_byte(code, cursor);
        match context.completions(code, byte) {
            Ok(found) => completion::from_evcxr(found, code),
            Err(error) => {
                tracing::debug!("completion failed: {error}");
                CompletionOutcome {
                    start: cursor,
                    end: cursor,
                    ..Default::default()
                }
            }
        }
    }

    /// Asks the code analysis for the members of each of [`path_completions::WARM_PATHS`] and
    /// keeps them in `paths`. The first request loads the crate graph (tch's included), so the
    /// analysis is ready before the user's first request, and until it is, `paths` answers.
    pub fn warm_up_analysis(&mut self, paths: &PathCompletions) {
        let started = Instant::now();
        for path in path_completions::WARM_PATHS {
            self.remember_path(path, paths);
        }
        tracing::info!(
            "code analysis ready in {:.1} s ({} paths remembered)",
            started.elapsed().as_secs_f64(),
            path_completions::WARM_PATHS.len()
        );
    }

    /// Keeps the members of `path` (which ends in `::`) in `paths`.
    pub fn remember_path(&mut self, path: &str, paths: &PathCompletions) {
        let found = self.complete(path, path.chars().count());
        paths.remember(path, &found.candidates);
    }

    /// Hover documentation at a character cursor.
    pub fn inspect(&mut self, code: &str, cursor: usize) -> InspectOutcome {
        let Some((context, _)) = self.context.as_mut() else {
            return InspectOutcome::default();
        };
        // rust-analyzer hovers the token before the offset; extend to the end of the word so
        // that a cursor in the middle of a name still finds it.
        let mut byte = char_to_byte(code, cursor);
        byte += code[byte..]
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(code.len() - byte);
        match context.hover_at(code, byte) {
            Ok((plain, html)) => InspectOutcome { plain, html },
            Err(error) => {
                tracing::debug!("inspect failed: {error}");
                InspectOutcome::default()
            }
        }
    }
}

impl Runner for Session {
    fn run(&mut self, code: &str, io: CellIo) -> CellOutcome {
        self.run_code(code, io)
    }

    fn start_world(&mut self, ranks: usize) -> Result<Session, String> {
        if !self.prelude_loaded() {
            return Err(
                "a %%distributed world needs tch and the tchmem runtime, which this \
                        kernel could not load (see its first cell's message)"
                    .to_string(),
            );
        }
        let workdir =
            workdir::prepare_world(&self.workdir).map_err(|error| format!("{error:#}"))?;
        let mut world =
            Session::start(self.config.world(ranks, workdir), Arc::clone(&self.control));
        if let Some(why) = world.fatal.take() {
            return Err(why);
        }
        if !world.prelude_loaded() {
            return Err(world.notices.join("\n"));
        }
        Ok(world)
    }

    fn has_runtime(&self) -> bool {
        self.child_setup.is_some()
    }

    fn dependency_source(&self, krate: &str) -> Option<std::path::PathBuf> {
        self.dependency_sources.of(&self.workdir, krate)
    }

    fn process_generation(&self) -> u64 {
        self.generation
    }

    fn variables(&self) -> Vec<(String, String)> {
        self.context.as_ref().map_or_else(Vec::new, |(context, _)| {
            context
                .variables_and_types()
                .map(|(name, ty)| (name.to_string(), ty.to_string()))
                .collect()
        })
    }

    fn take_commands(&mut self, code: &str) -> (String, Vec<Result<String, String>>) {
        match self.cell_build.as_mut() {
            Some(cell_build) => cell_build.take_commands(code),
            None => (code.to_string(), Vec::new()),
        }
    }

    fn set_line_tables(&mut self, on: bool) {
        if let Some(cell_build) = self.cell_build.as_mut() {
            if let Err(error) = cell_build.set_line_tables(on) {
                tracing::warn!("could not switch the cells' line tables: {error}");
            }
        }
    }

    fn generated_source(&self) -> Vec<String> {
        std::fs::read_to_string(self.workdir.join("src").join("lib.rs"))
            .map(|text| text.lines().map(str::to_string).collect())
            .unwrap_or_default()
    }
}

/// evcxr keeps nothing of a cell that failed to compile, its `use` lines included, so the next
/// cells would fail on names the user imported: they are run alone and kept, and the error says
/// whether they were.
fn keep_uses(context: &mut CommandContext, code: &str, error: &mut CellError) {
    let uses = cell_syntax::top_level_uses(code);
    if uses.is_empty() {
        return;
    }
    let note = match context.execute(&uses.join("\n")) {
        Ok(_) => "tchmem: the cell's `use` lines were kept for the next cells (its other items \
                  and variables were not: run the cell again once it compiles)"
            .to_string(),
        Err(_) => "tchmem: the cell's `use` lines were not kept either (they name what the cell \
                   defines): run the cell again once it compiles"
            .to_string(),
    };
    error.traceback.push(String::new());
    error.traceback.push(note);
}

/// Whether `result` is a compile error about an inserted loop check, not the user's code.
fn failed_on_a_check(result: &Result<evcxr::EvalOutputs, evcxr::Error>) -> bool {
    match result {
        Err(evcxr::Error::CompilationErrors(errors)) => errors
            .iter()
            .any(|e| loop_checks::about_a_check(&e.message(), &e.json)),
        _ => false,
    }
}

/// Takes the rest of a cell's output off the pump: trailing rich blocks shown or kept as the
/// result, evcxr's timing line, and the panic the cell died of (or survived).
fn settle_output(
    pump: &StreamPump,
    outcome: &mut CellOutcome,
    output: &OutputSink,
    took: Option<&str>,
) {
    let token = outcome.report.as_ref().map(|r| r.sync_token.as_str());
    let mut leftovers = pump.detach(token, STDERR_GRACE);
    let panicked = outcome.report.as_ref().is_some_and(|r| r.panicked);
    let succeeded = outcome.error.is_none() && !panicked;
    let (shown, result) = std::mem::take(&mut leftovers.trailing).finish(succeeded);
    for block in shown {
        output(CellOutput::Display(rich::display(block)));
    }
    outcome
        .data
        .extend(result.into_iter().map(|block| (block.mime, block.content)));
    // A cell ending in a call that returns `()` has nothing to show (as Python's None).
    let data = &mut outcome.data;
    if data.len() == 1 && data.get("text/plain").is_some_and(|text| text == "()") {
        data.clear();
    }
    if let Some(took) = took {
        output(CellOutput::Stream(StreamName::Stdout, took.to_string()));
    }
    let stopped = outcome.report.as_ref().and_then(|r| r.stopped.as_ref());
    if let (true, Some(stopped)) = (panicked, stopped) {
        outcome.error = Some(errors::stopped_at(stopped));
    } else if panicked {
        outcome.error = Some(errors::panic(&leftovers));
    } else {
        // Panics the cell survived (a worker thread's, a caught one) are still worth seeing.
        for panic in &leftovers.panics {
            output(CellOutput::Stream(
                StreamName::Stderr,
                errors::describe_panic(panic),
            ));
        }
    }
}
