//! The engine thread's side: owns the evcxr context and runs jobs.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use evcxr::{CommandContext, EvalCallbacks};

use super::errors::{self, CellError, Termination};
use super::infer;
use super::positions::{byte_to_char, char_to_byte};
use super::setup::{create_context, EngineConfig};
use super::streams::{CellOutput, StreamName, StreamPump};
use super::{CellIo, CellOutcome, CompletionOutcome, Control, InspectOutcome};
use tchmem_wire::memory::MemoryRecord;
use tchmem_wire::{CellReport, CELL_REPORT_MIME};

use crate::magics::{self, CellMagic, Magic, MagicReply, ProfileMode};
use crate::report;

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

/// A magic's help (shown) or mistake (the cell's `MagicError`).
fn magic_reply(reply: MagicReply, io: &CellIo) -> Result<(), CellError> {
    match reply {
        MagicReply::Help(help) => {
            (io.output)(CellOutput::Stream(StreamName::Stdout, help + "\n"));
            Ok(())
        }
        MagicReply::Error(message) => Err(CellError::new("MagicError", message)),
    }
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
    control: Arc<Control>,
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

    /// Runs one cell: its magics, then its code, then records its memory.
    pub fn execute(&mut self, cell: &str, io: CellIo) -> CellOutcome {
        self.runs += 1;
        if let Some(source) = magics::cell_magic(cell) {
            return match magics::parse_cell(&source) {
                Ok(CellMagic::Optimize(request)) => self.optimize(&request, &source, io),
                Err(reply) => CellOutcome {
                    error: magic_reply(reply, &io).err(),
                    ..Default::default()
                },
            };
        }
        let (magic_lines, code) = magics::split(cell);
        for line in magic_lines {
            if let Err(error) = self.apply_magic(line, &io) {
                return CellOutcome {
                    error: Some(error),
                    ..Default::default()
                };
            }
        }
        if code.trim().is_empty() {
            return CellOutcome::default();
        }
        self.run_cell_code(code, io)
    }

    /// Runs a cell's code and records its memory (shown per `%memprofile`).
    pub(super) fn run_cell_code(&mut self, code: &str, io: CellIo) -> CellOutcome {
        let mut outcome = self.run_code(code, io);
        if outcome.error.is_none() {
            if let Some(categories) = self.watch_new_var_stores(code) {
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
    /// bound anew (the user need not call `tchmem::watch`). Returns the categories measured after
    /// watching them, if any were.
    fn watch_new_var_stores(&mut self, code: &str) -> Option<Vec<tchmem_wire::memory::Category>> {
        self.child_setup?; // no runtime, nothing to watch with
        let (context, _) = self.context.as_ref()?;
        let new: Vec<String> = context
            .variables_and_types()
            .filter(|(_, ty)| ty.rsplit("::").next() == Some("VarStore"))
            .map(|(name, _)| name.to_string())
            .filter(|name| !self.auto_watched.contains(name) || binds(code, name))
            .collect();
        if new.is_empty() {
            return None;
        }
        let code: String = new
            .iter()
            .map(|name| format!("tchmem::watch(&{name});\n"))
            .collect();
        self.auto_watched.extend(new);
        let quiet: super::OutputSink = Arc::new(|_| {});
        let outcome = self.run_code(
            &code,
            CellIo {
                output: quiet,
                input: None,
            },
        );
        if let Some(error) = &outcome.error {
            tracing::debug!("could not watch a VarStore: {}", error.evalue);
            return None;
        }
        outcome.report?.memory.map(|record| record.categories)
    }

    fn apply_magic(&mut self, line: &str, io: &CellIo) -> Result<(), CellError> {
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
            Ok(Magic::History) => {
                (io.output)(CellOutput::Display(report::history_display(&self.records)));
            }
            Ok(Magic::Summary) => {
                let last = self.records.last().map(|(run, record)| (*run, record));
                (io.output)(CellOutput::Display(report::summary_display(last)));
            }
            Err(reply) => return magic_reply(reply, io),
        }
        Ok(())
    }

    /// Runs Rust code (and evcxr commands) in the context.
    fn run_code(&mut self, code: &str, io: CellIo) -> CellOutcome {
        if std::mem::take(&mut self.child_restarted) {
            if let Some(setup) = self.child_setup {
                // The first cell after evcxr's :restart can take the new child down again
                // (evcxr still expects the old variables); evcxr then starts a clean one, so
                // one more try.
                for attempt in 1..=2 {
                    let quiet: super::OutputSink = Arc::new(|_| {});
                    let outcome = self.run_code(
                        setup,
                        CellIo {
                            output: quiet,
                            input: None,
                        },
                    );
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
        pump.attach(Arc::clone(&io.output));
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
        let mut result = context.execute_with_callbacks(code, &mut callbacks);
        if let Err(evcxr::Error::Message(message)) = &result {
            if let Some(annotated) = typed_by_compiler(context, code, message, &io.output) {
                result = context.execute_with_callbacks(&annotated, &mut callbacks);
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
        match result {
            Ok(outputs) => {
                let mut data = outputs.content_by_mime_type;
                outcome.report = data
                    .remove(CELL_REPORT_MIME)
                    .and_then(|json| serde_json::from_str::<CellReport>(&json).ok());
                // A cell ending in a call that returns `()` has nothing to show (as Python's
                // None).
                if data.len() == 1 && data.get("text/plain").is_some_and(|text| text == "()") {
                    data.clear();
                }
                outcome.data = data.into_iter().collect();
                if let Some(timing) = outputs.timing {
                    let took = format!("Took {}ms\n", timing.as_millis());
                    (io.output)(CellOutput::Stream(StreamName::Stdout, took));
                }
            }
            Err(error) => {
                let termination = if interrupted {
                    Termination::Interrupted
                } else {
                    Termination::Crashed
                };
                outcome.error = Some(errors::from_evcxr(error, code, termination));
            }
        }
        let token = outcome.report.as_ref().map(|r| r.sync_token.as_str());
        let leftovers = pump.detach(token, STDERR_GRACE);
        let panicked = outcome.report.as_ref().is_some_and(|r| r.panicked);
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
            Ok(found) => CompletionOutcome {
                matches: found.completions.into_iter().map(|c| c.code).collect(),
                start: byte_to_char(code, found.start_offset),
                end: byte_to_char(code, found.end_offset),
            },
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
    use super::binds;

    #[test]
    fn let_bindings_are_recognised() {
        assert!(binds("let vs = nn::VarStore::new(d);", "vs"));
        assert!(binds("let mut vs: nn::VarStore = x;", "vs"));
        assert!(!binds("let vs2 = 1; watch(&vs);", "vs"));
        assert!(!binds("tchmem::watch(&vs);", "vs"));
    }
}
