//! The engine thread's side: owns the evcxr context and runs jobs.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use evcxr::{CommandContext, EvalCallbacks};

use super::auto_watch;
use super::cell_opt;
use super::errors::{self, CellError, Termination};
use super::infer;
use super::positions::char_to_byte;
use super::rich;
use super::setup::{create_context, EngineConfig};
use super::streams::{CellOutput, StreamName, StreamPump};
use super::{CellIo, CellOutcome, CompletionOutcome, Control, InspectOutcome};
use tchmem_wire::memory::MemoryRecord;
use tchmem_wire::{CellReport, CELL_REPORT_MIME};

use crate::cell_syntax::{self, Syntax, Tail};
use crate::magics::memprofile::MemProfileRequest;
use crate::magics::optimize::OptimizeRequest;
use crate::magics::{self, CellMagic, CellMagicSource, Magic, MagicReply, ProfileMode};
use crate::report;
use crate::rewrite;

/// The id of the child process now running cells.
fn child_pid(control: &Control) -> Option<u32> {
    let child = control.child.lock().unwrap_or_else(|e| e.into_inner());
    let child = child.as_ref()?.lock().unwrap_or_else(|e| e.into_inner());
    Some(child.id())
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
        MagicReply::Error(message) => Err(CellError::new("MagicError", message)),
    }
}

/// Whether `code` is one of evcxr's help commands (`:help`, `:doc NAME`) and nothing else, so
/// that its output belongs in the pager, as ipykernel's `?`.
fn is_help_command(code: &str) -> bool {
    let mut lines = code
        .lines()
        .filter(|line| !line.trim().is_empty() && !line.starts_with("//"));
    match (lines.next(), lines.next()) {
        (Some(line), None) => {
            // evcxr's command syntax: optional spaces, `:name`, then arguments after spaces.
            let name = line.trim_start_matches(' ').split(' ').next();
            matches!(name, Some(":help" | ":doc"))
        }
        _ => false,
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

/// What the OOM diagnosis reads from a cell (only cells that could be training loops are parsed).
fn failed_cell(code: &str) -> crate::fit::diagnosis::FailedCell {
    if !code.contains("backward") {
        return Default::default();
    }
    let facts = rewrite::training_facts(code);
    crate::fit::diagnosis::FailedCell {
        batch: rewrite::batch::find(code).ok(),
        optimizer: facts.optimizer.map(|(name, _)| name),
        trains: facts.trains,
    }
}

/// Help texts as a pager bundle (none when there are none).
fn help_page(help: Vec<String>) -> std::collections::BTreeMap<String, String> {
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

/// When evcxr's analysis could not type a variable the cell defines: the cell with the types
/// the compiler names written out (see [`super::infer`]), after telling the user; `None` when
/// the compiler cannot help either.
fn typed_by_compiler(
    context: &mut CommandContext,
    code: &str,
    message: &str,
    output: &super::OutputSink,
) -> Option<String> {
    let variable = infer::unknown_variable(message)?;
    let lets = infer::untyped_lets(code).unwrap_or_default();
    tracing::debug!("type probe for `{variable}`: untyped lets {lets:?}");
    if lets.is_empty() {
        return None;
    }
    let probe = context.execute(&infer::probe_cell(code, &lets));
    let errors = match probe {
        Err(evcxr::Error::CompilationErrors(errors)) => errors,
        other => {
            tracing::debug!("type probe: no compile errors to read: {:?}", other.err());
            return None;
        }
    };
    tracing::debug!(
        "type probe: {:?}",
        errors.iter().map(|e| e.rendered()).collect::<Vec<_>>()
    );
    let types: Vec<String> = errors
        .iter()
        .filter(|e| e.code() == Some("E0308"))
        .map(|e| infer::found_type(&e.rendered()))
        .collect::<Option<_>>()?;
    if types.len() != lets.len() {
        return None;
    }
    output(CellOutput::Stream(
        StreamName::Stderr,
        format!(
            "tchmem: the code analysis could not tell the type of `{variable}`; the compiler \
             names {}, so the cell runs with that written out (a type the cell has not \
             imported needs a `use`, or write the type yourself)\n",
            lets.iter()
                .zip(&types)
                .map(|(l, t)| format!("`{}: {t}`", l.probe))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    ));
    Some(infer::annotate(code, &lets, &types))
}

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
    child_setup: Option<&'static str>,
    /// The child was restarted (crash, interrupt) and has not been set up again.
    child_restarted: bool,
    /// When memory summaries are shown (`%memprofile`).
    profile_mode: ProfileMode,
    /// Memory records of every cell so far, numbered by run.
    records: Vec<(usize, MemoryRecord)>,
    /// Cells run so far (magic-only cells included).
    runs: usize,
    /// Variables holding a VarStore that the session already watches for the user.
    auto_watched: std::collections::HashSet<String>,
    /// The cells' own optimisation level (`:opt`); `None` when its file could not be written.
    cell_opt: Option<cell_opt::CellOpt>,
    /// Timelines (`%%memprofile`, `%memprofile timeline on`), see [`Timelines`].
    timelines: Timelines,
    /// The last cell with a training step that ran (failed ones too): what `%memestimate` and
    /// `%memfit` act on when they are alone in their cell.
    pub(super) last_training_cell: Option<String>,
    control: Arc<Control>,
}

/// What the session keeps for allocation timelines.
#[derive(Default)]
struct Timelines {
    /// Where snapshots are written.
    dir: std::path::PathBuf,
    /// The compile directory (its generated `src/lib.rs` maps stacks to cells).
    workdir: std::path::PathBuf,
    /// `%memprofile timeline on`: a timeline for every later cell.
    every_cell: Option<MemProfileRequest>,
    /// The next cell's timeline (`%%memprofile`).
    next: Option<MemProfileRequest>,
    /// The last snapshot written (for `%memsnapshot`), or why the last profiled cell has none.
    last_snapshot: Option<Result<String, String>>,
    /// Code of every cell run, by execution count, as compiled (for stack frames).
    cells: Vec<(usize, String)>,
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
            profile_mode: ProfileMode::default(),
            records: Vec::new(),
            runs: 0,
            auto_watched: Default::default(),
            cell_opt: None,
            timelines: Timelines {
                dir: super::timeline::snapshot_dir(&config.workdir),
                workdir: config.workdir.clone(),
                ..Default::default()
            },
            last_training_cell: None,
            control,
        };
        match create_context(&config) {
            Ok((context, outputs)) => {
                *session
                    .control
                    .child
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()) = Some(context.process_handle());
                let pump = StreamPump::start(outputs.stdout, outputs.stderr);
                session.context = Some((context, pump));
                session.cell_opt = cell_opt::CellOpt::start(&config.workdir)
                    .inspect_err(|error| {
                        tracing::warn!("cells keep evcxr's optimisation level: {error}")
                    })
                    .ok();
            }
            Err(error) => {
                tracing::error!("{error:#}");
                session.fatal = Some(format!("{error:#}"));
                return session;
            }
        }
        if let Some(problem) = &config.libtorch_problem {
            session
                .notices
                .push(format!("tch is not available in this kernel: {problem}"));
        }
        if let Some(prelude) = config.prelude() {
            tracing::info!("compiling the prelude (tch {})", super::setup::TCH_VERSION);
            let sink: super::OutputSink = Arc::new(|output| tracing::debug!("prelude: {output:?}"));
            let outcome = session.run_code(
                &prelude,
                CellIo {
                    output: sink,
                    input: None,
                },
            );
            if outcome.error.is_none() {
                session.child_setup = Some(super::setup::CHILD_SETUP);
                session.check_dependencies(&config.workdir, &prelude);
            }
            if let Some(error) = outcome.error {
                session.notices.push(format!(
                    "tch could not be added to this kernel: {}\n{}",
                    error.evalue,
                    error.traceback.join("\n")
                ));
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

    /// Runs one cell: its magics, then its code, then records its memory.
    pub fn execute(&mut self, cell: &str, io: CellIo) -> CellOutcome {
        self.runs += 1;
        let mut help = Vec::new();
        if let Some(source) = magics::cell_magic(cell) {
            return match magics::parse_cell(&source) {
                Ok(CellMagic::Optimize(request)) => self.optimize(&request, &source, io),
                Ok(CellMagic::MemProfile(request)) => self.memprofile(request, &source, io),
                Ok(CellMagic::Estimate(request)) => self.memestimate(&request, &source, io),
                Ok(CellMagic::Fit(args)) => self.memfit(&args, &source, io),
                Err(reply) => cell_magic_reply(reply),
            };
        }
        let (magic_lines, code) = magics::split(cell);
        for line in magic_lines {
            if let Err(error) = self.apply_magic(line, &io, &mut help) {
                return CellOutcome {
                    error: Some(error),
                    ..Default::default()
                };
            }
        }
        // The magic lines become blank lines, so the lines compile errors name are the cell's.
        let skipped = cell[..cell.len() - code.len()].matches('\n').count();
        // evcxr's `:opt` sets the level of the cells' own code here (see cell_opt).
        let code = match self.cell_opt.as_mut() {
            Some(cell_opt) => {
                let (rest, said) = cell_opt.take_commands(code);
                for answer in said {
                    match answer {
                        Ok(text) => {
                            (io.output)(CellOutput::Stream(StreamName::Stdout, text + "\n"))
                        }
                        Err(why) => {
                            return CellOutcome {
                                error: Some(CellError::new("CommandError", why)),
                                ..Default::default()
                            }
                        }
                    }
                }
                std::borrow::Cow::Owned(rest)
            }
            None => std::borrow::Cow::Borrowed(code),
        };
        let code = code.as_ref();
        // A cheap test first: every training step the rewriter knows calls `backward`.
        if code.contains("backward") && rewrite::training_facts(code).trains {
            self.last_training_cell = Some(code.to_string());
        }
        let mut outcome = if code.trim().is_empty() {
            CellOutcome::default()
        } else {
            let padded = format!("{}{code}", "\n".repeat(skipped));
            let output = Arc::clone(&io.output);
            let mut outcome = self.run_cell_code(&padded, io);
            // A training cell that ran out of CUDA memory: measure what would fit.
            if let Some(error) = outcome.error.as_mut() {
                if error.ename == "OutOfMemory" && code.contains("backward") {
                    if let Some(fixes) = self.measured_oom_fixes(code, &output) {
                        error.evalue.push_str(&fixes);
                    }
                }
            }
            outcome
        };
        if is_help_command(code) && outcome.error.is_none() {
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

    /// Runs a cell's code and records its memory (shown per `%memprofile`).
    pub(super) fn run_cell_code(&mut self, code: &str, io: CellIo) -> CellOutcome {
        // Stores the cell visibly makes are watched inside it (no second compile).
        let (code, watched_in_cell) = match self.child_setup {
            Some(_) => auto_watch::watch_where_made(code),
            None => (code.to_string(), Vec::new()),
        };
        self.timelines.cells.push((self.runs, code.clone()));
        let profile = self
            .timelines
            .next
            .take()
            .or_else(|| self.timelines.every_cell.clone())
            .filter(|_| self.child_setup.is_some());
        let code = match &profile {
            Some(profile) => {
                let path = self
                    .timelines
                    .dir
                    .join(format!("cell-{}.pickle", self.runs));
                super::timeline::with_recording(&code, &super::timeline::request(profile, &path))
            }
            None => code,
        };
        // Frames name cell lines only when the cell has line tables.
        let stacks = profile.as_ref().is_some_and(|p| p.stacks);
        if let Some(cell_opt) = self.cell_opt.as_mut() {
            if let Err(error) = cell_opt.set_line_tables(stacks) {
                tracing::warn!("could not switch the cells' line tables: {error}");
            }
        }
        let output = Arc::clone(&io.output);
        let mut outcome = self.run_code(&code, io);
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
        let record = outcome.report.as_ref().and_then(|report| {
            let mut record = report.memory.clone()?;
            record.recording_seconds = Some(report.recording_seconds);
            record.wall_seconds = Some(report.wall_seconds);
            Some(record)
        });
        if let Some(error) = outcome.error.take() {
            // Without a record (recording off, no runtime) libtorch's message can still tell.
            let none = MemoryRecord::default();
            outcome.error = Some(errors::out_of_memory(
                error,
                record.as_ref().unwrap_or(&none),
                &failed_cell(&code),
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
        outcome
    }

    /// Watches VarStores the user's variables hold that are not watched yet, or that `code` just
    /// bound anew (the user need not call `tchmem::watch`), but for those `code` watched itself.
    /// Returns the categories measured after watching them, if any were.
    fn watch_new_var_stores(
        &mut self,
        code: &str,
        watched_in_cell: &[String],
    ) -> Option<Vec<tchmem_wire::memory::Category>> {
        self.child_setup?; // no runtime, nothing to watch with
        let (context, _) = self.context.as_ref()?;
        let new: Vec<String> = context
            .variables_and_types()
            .filter(|(_, ty)| ty.rsplit("::").next() == Some("VarStore"))
            .map(|(name, _)| name.to_string())
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
        let outcome = self.run_code(&code, CellIo::quiet());
        if let Some(error) = &outcome.error {
            tracing::debug!("could not watch a VarStore: {}", error.evalue);
            return None;
        }
        outcome.report?.memory.map(|record| record.categories)
    }

    /// Runs a `%%memprofile` cell: its body (itself perhaps an `%%optimize` cell) with a timeline.
    fn memprofile(
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
                Ok(CellMagic::Optimize(optimize)) if optimize.compare.is_some() => CellOutcome {
                    error: Some(CellError::new(
                        "MagicError",
                        "%%memprofile records one run; %%optimize --compare makes two. Profile \
                         the rewritten loop without --compare (or each version in its own cell)."
                            .to_string(),
                    )),
                    ..Default::default()
                },
                Ok(CellMagic::Optimize(OptimizeRequest { fit: Some(_), .. }))
                | Ok(CellMagic::Estimate(_))
                | Ok(CellMagic::Fit(_)) => CellOutcome {
                    error: Some(CellError::new(
                        "MagicError",
                        "%%memprofile records one run; this magic runs the cell in several \
                         trials. Profile the loop it chooses in a cell of its own."
                            .to_string(),
                    )),
                    ..Default::default()
                },
                Ok(CellMagic::Optimize(optimize)) => {
                    self.timelines.next = Some(request);
                    let outcome = self.optimize(&optimize, &inner, io);
                    self.timelines.next = None;
                    outcome
                }
                Ok(CellMagic::MemProfile(_)) => CellOutcome {
                    error: Some(CellError::new(
                        "MagicError",
                        "%%memprofile appears twice at the top of this cell; keep one.".to_string(),
                    )),
                    ..Default::default()
                },
                Err(reply) => cell_magic_reply(reply),
            };
        }
        self.timelines.next = Some(request);
        let padded = format!("{}{}", "\n".repeat(magic_line + 1), source.body);
        let outcome = self.run_cell_code(&padded, io);
        self.timelines.next = None;
        outcome
    }

    /// Draws the timeline the runtime captured around the cell that just ran, and writes its
    /// snapshot where `--snapshot` asked.
    fn show_timeline(
        &mut self,
        profile: &MemProfileRequest,
        outcome: &CellOutcome,
        output: &super::OutputSink,
    ) {
        let capture = outcome
            .report
            .as_ref()
            .and_then(|r| r.memory.as_ref())
            .and_then(|m| m.timeline.clone());
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
        let sources = crate::timeline::sites::CellSources::new(
            super::timeline::generated_source(&self.timelines.workdir),
            &self.timelines.cells,
        );
        output(CellOutput::Display(super::timeline::display(
            &capture, &sources, self.runs,
        )));
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
    fn write_snapshot(&self, path: &str) -> Result<String, CellError> {
        let last = match &self.timelines.last_snapshot {
            None => {
                return Err(CellError::new(
                    "MagicError",
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
                CellError::new("MagicError", format!("could not write {path}: {error}"))
            })
    }

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

    /// Cells run so far (for display ids that must differ between cells).
    pub(super) fn runs(&self) -> usize {
        self.runs
    }

    /// Runs Rust code (and evcxr commands) in the context.
    pub(super) fn run_code(&mut self, code: &str, io: CellIo) -> CellOutcome {
        if std::mem::take(&mut self.child_restarted) {
            if let Some(setup) = self.child_setup {
                // The first cell after evcxr's :restart can take the new child down again
                // (evcxr still expects the old variables); evcxr then starts a clean one, so
                // one more try.
                for attempt in 1..=2 {
                    let outcome = self.run_code(setup, CellIo::quiet());
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
        }
        for notice in self.notices.drain(..) {
            (io.output)(CellOutput::Stream(
                StreamName::Stderr,
                format!("{notice}\n"),
            ));
        }
        let Some((context, pump)) = self.context.as_mut() else {
            let why = self.fatal.clone().unwrap_or_default();
            return CellOutcome {
                error: Some(CellError::new("KernelNotReady", why)),
                ..Default::default()
            };
        };
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
        self.control
            .interrupt_requested
            .store(false, Ordering::SeqCst);
        let child_before = child_pid(&self.control);
        *self
            .control
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = true;
        let started = Instant::now();
        let mut result = context.execute_with_callbacks(code, &mut callbacks);
        tracing::debug!("evcxr compiled and ran the cell in {:?}", started.elapsed());
        // The code compile errors point into: the cell, or the cell with types written out.
        let mut compiled = std::borrow::Cow::Borrowed(code);
        if let Err(evcxr::Error::Message(message)) = &result {
            if let Some(annotated) = typed_by_compiler(context, code, message, &io.output) {
                result = context.execute_with_callbacks(&annotated, &mut callbacks);
                compiled = annotated.into();
            }
        }
        *self
            .control
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = false;
        // A crash, an interrupt, or evcxr's :restart / :clear: a new child needs setting up.
        if child_pid(&self.control) != child_before {
            self.child_restarted = true;
            self.auto_watched.clear();
        }
        let interrupted = self
            .control
            .interrupt_requested
            .swap(false, Ordering::SeqCst);

        let mut outcome = CellOutcome::default();
        let mut timing = None;
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
            }
            Err(error) => {
                let termination = if interrupted {
                    Termination::Interrupted
                } else {
                    Termination::Crashed
                };
                outcome.error = Some(errors::from_evcxr(error, &compiled, termination));
            }
        }
        let token = outcome.report.as_ref().map(|r| r.sync_token.as_str());
        let mut leftovers = pump.detach(token, STDERR_GRACE);
        tracing::debug!(
            "the cell's output was drained {:?} after it began",
            started.elapsed()
        );
        let panicked = outcome.report.as_ref().is_some_and(|r| r.panicked);
        let succeeded = outcome.error.is_none() && !panicked;
        let (shown, result) = std::mem::take(&mut leftovers.trailing).finish(succeeded);
        for block in shown {
            (io.output)(CellOutput::Display(rich::display(block)));
        }
        outcome
            .data
            .extend(result.into_iter().map(|block| (block.mime, block.content)));
        // A cell ending in a call that returns `()` has nothing to show (as Python's None).
        let data = &mut outcome.data;
        if data.len() == 1 && data.get("text/plain").is_some_and(|text| text == "()") {
            data.clear();
        }
        if let Some(timing) = timing {
            let took = format!("Took {}ms\n", timing.as_millis());
            (io.output)(CellOutput::Stream(StreamName::Stdout, took));
        }
        if panicked {
            outcome.error = Some(errors::panic(&leftovers));
        } else {
            // Panics the cell survived (a worker thread's, a caught one) are still worth seeing.
            for panic in &leftovers.panics {
                (io.output)(CellOutput::Stream(
                    StreamName::Stderr,
                    errors::describe_panic(panic),
                ));
            }
        }
        outcome
    }

    /// Completions at a character cursor.
    pub fn complete(&mut self, code: &str, cursor: usize) -> CompletionOutcome {
        let Some((context, _)) = self.context.as_mut() else {
            return CompletionOutcome::default();
        };
        let byte = char_to_byte(code, cursor);
        match context.completions(code, byte) {
            Ok(found) => super::completion::from_evcxr(found, code),
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

    /// Runs one completion nobody asked for, so that the code analysis has loaded the crate
    /// graph (tch's included) before the user's first request.
    pub fn warm_up_analysis(&mut self) {
        let started = Instant::now();
        let found = self.complete("tch::Tensor::zer", "tch::Tensor::zer".len());
        tracing::info!(
            "code analysis ready in {:.1} s ({} completions for a test request)",
            started.elapsed().as_secs_f64(),
            found.matches.len()
        );
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

#[cfg(test)]
mod tests {
    use super::{binds, is_help_command};

    #[test]
    fn help_commands_alone_in_a_cell_go_to_the_pager() {
        assert!(is_help_command(":help"));
        assert!(is_help_command("\n  :help\n"));
        assert!(is_help_command("// what is there?\n:doc Vec"));
        assert!(!is_help_command(":helpme"));
        assert!(!is_help_command(":vars"));
        assert!(!is_help_command(":help\nlet x = 1;"));
        assert!(!is_help_command("let help = 1;"));
    }

    #[test]
    fn let_bindings_are_recognised() {
        assert!(binds("let vs = nn::VarStore::new(d);", "vs"));
        assert!(binds("let mut vs: nn::VarStore = x;", "vs"));
        assert!(!binds("let vs2 = 1; watch(&vs);", "vs"));
        assert!(!binds("tchmem::watch(&vs);", "vs"));
    }
}
