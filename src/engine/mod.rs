//! The evaluation engine: an evcxr `CommandContext` on a thread of its own.
//!
//! Everything that touches evcxr runs on that thread, one job at a time, in arrival order; the
//! handle ([`Engine`]) is cheap to clone and hands results back through oneshot channels, so the
//! async kernel and the synchronous notebook runner drive it the same way. Interrupts bypass the
//! queue (see [`Engine::interrupt`]).

mod auto_watch;
mod cell_opt;
mod completion;
mod errors;
mod fit;
mod infer;
mod optimize;
mod positions;
mod rich;
mod session;
mod setup;
mod startup;
mod streams;
mod timeline;
pub mod workdir;

use std::collections::BTreeMap;
use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;

pub use completion::{metadata as completion_metadata, Candidate};
pub use errors::CellError;
pub use setup::{EngineConfig, TCH_VERSION};
pub use startup::{Progress, Stage};
pub use streams::{CellOutput, OutputSink, StreamName};

use session::Session;
use startup::Startup;
use tchmem_wire::CellReport;

/// Asks the user for a line of input: `(prompt, is_password) -> reply`.
pub type InputFn = Box<dyn Fn(&str, bool) -> String + Send>;

/// Where a running cell's side output goes.
pub struct CellIo {
    /// Stream output and displays, delivered while the cell runs.
    pub output: OutputSink,
    /// Answers input requests; `None` when the frontend does not allow stdin.
    pub input: Option<InputFn>,
}

impl CellIo {
    /// Output dropped, no input: for code the kernel runs for itself (set-up, probes, trials).
    pub fn quiet() -> CellIo {
        CellIo {
            output: Arc::new(|_| {}),
            input: None,
        }
    }
}

/// What one cell produced, besides its streams.
#[derive(Debug, Default)]
pub struct CellOutcome {
    /// The cell's rich result by MIME type (the value of its final expression, `:` command
    /// output); empty when there is none.
    pub data: BTreeMap<String, String>,
    /// Set when the cell failed (compile error, panic, crash, interrupt).
    pub error: Option<CellError>,
    /// The child's report of the run, when the cell's code ran.
    pub report: Option<CellReport>,
    /// The memory summary to show after the cell's result (per `%memprofile`).
    pub memory_display: Option<tchmem_wire::Display>,
    /// Help for a pager, by MIME type (`:help`, `:doc`, a magic's `--help`); empty when none.
    /// The kernel sends it as the execute reply's `page` payload, where JupyterLab shows it
    /// under the cell; `tchmem execute` writes it as the `display_data` output JupyterLab
    /// records for it.
    pub page: BTreeMap<String, String>,
}

impl CellOutcome {
    /// Takes the cell's result as a Jupyter bundle (JSON MIME types as JSON).
    pub fn take_result(&mut self) -> serde_json::Map<String, serde_json::Value> {
        bundle(std::mem::take(&mut self.data))
    }

    /// Takes the help for the pager as a Jupyter bundle.
    pub fn take_page(&mut self) -> serde_json::Map<String, serde_json::Value> {
        bundle(std::mem::take(&mut self.page))
    }
}

fn bundle(data: BTreeMap<String, String>) -> serde_json::Map<String, serde_json::Value> {
    data.into_iter()
        .map(|(mime, text)| {
            let value = tchmem_wire::bundle_value(&mime, &text);
            (mime, value)
        })
        .collect()
}

/// A completion answer: candidates replacing the characters `start..end` (in chars).
#[derive(Debug, Default)]
pub struct CompletionOutcome {
    /// Candidate texts.
    pub matches: Vec<String>,
    /// First replaced character (Unicode scalar index, as Jupyter counts).
    pub start: usize,
    /// One past the last replaced character.
    pub end: usize,
    /// What each match is (kind and signature), in the order of `matches`.
    pub candidates: Vec<Candidate>,
}

/// Documentation for the expression at a cursor.
#[derive(Debug, Default)]
pub struct InspectOutcome {
    /// Plain-text documentation; empty when nothing was found.
    pub plain: String,
    /// The same as HTML.
    pub html: String,
}

type Job = Box<dyn FnOnce(&mut Session) + Send>;

/// State shared with the engine thread that must be reachable while it is busy.
#[derive(Default)]
struct Control {
    /// A cell is running. A mutex, not an atomic: interrupt checks it and kills the child while
    /// holding it, so a cell that just finished cannot lose its process to a late interrupt.
    running: Mutex<bool>,
    interrupt_requested: AtomicBool,
    child: Mutex<Option<Arc<Mutex<Child>>>>,
}

/// Handle to the engine thread.
#[derive(Clone)]
pub struct Engine {
    jobs: mpsc::Sender<Job>,
    control: Arc<Control>,
    startup: Arc<Startup>,
}

impl Engine {
    /// Starts the engine thread. It creates the evcxr context and compiles the prelude (tch and
    /// the runtime crate) before taking jobs, so the first jobs wait for that.
    pub fn start(config: EngineConfig) -> Engine {
        let (jobs, queue) = mpsc::channel::<Job>();
        let control = Arc::new(Control::default());
        let thread_control = Arc::clone(&control);
        let startup = Arc::new(Startup::begin(config.workdir.clone()));
        let warm_up = config.warm_up_analysis;
        let thread_startup = Arc::clone(&startup);
        std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || {
                let mut session = Session::start(config, Arc::clone(&thread_control));
                thread_startup.finish(session.prelude_loaded());
                // The code analysis loads the crate graph on its first request (5 s after a
                // start, measured): do that at the first moment with nothing queued, so that the
                // user's first completion answers within a frontend's timeout.
                let mut warmed = !warm_up;
                loop {
                    let job = if warmed {
                        queue.recv().ok()
                    } else {
                        match queue.try_recv() {
                            Ok(job) => Some(job),
                            Err(mpsc::TryRecvError::Empty) => {
                                let _ =
                                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                        session.warm_up_analysis()
                                    }));
                                warmed = true;
                                continue;
                            }
                            Err(mpsc::TryRecvError::Disconnected) => None,
                        }
                    };
                    let Some(job) = job else { break };
                    // An internal evcxr panic must not take the kernel down with it.
                    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        job(&mut session)
                    }));
                    if caught.is_err() {
                        tracing::error!("internal error in the engine; continuing");
                        *thread_control
                            .running
                            .lock()
                            .unwrap_or_else(|e| e.into_inner()) = false;
                    }
                }
            })
            .expect("spawning the engine thread");
        Engine {
            jobs,
            control,
            startup,
        }
    }

    /// Calls `report` every `every` while the engine starts (compiles or loads the prelude);
    /// returns once it is ready, with how far the start went.
    pub fn report_start(&self, every: Duration, report: impl FnMut(&Progress)) -> Progress {
        self.startup.report_until_ready(every, report)
    }

    fn submit<T: Send + 'static>(
        &self,
        job: impl FnOnce(&mut Session) -> T + Send + 'static,
    ) -> oneshot::Receiver<T> {
        let (tx, rx) = oneshot::channel();
        let job: Job = Box::new(move |session| {
            let _ = tx.send(job(session));
        });
        if self.jobs.send(job).is_err() {
            tracing::error!("the engine thread has stopped");
        }
        rx
    }

    /// Runs a cell. Its outputs go to `io` while it runs. A cell that comes while the engine
    /// still starts shows the start's progress, updated in place, until it runs.
    pub fn execute(&self, code: String, io: CellIo) -> oneshot::Receiver<CellOutcome> {
        let waiting = (self.startup.stage() == Stage::Starting).then(|| {
            let startup = Arc::clone(&self.startup);
            let output = Arc::clone(&io.output);
            std::thread::spawn(move || startup::show_until_ready(&startup, &output))
        });
        self.submit(move |session| {
            // The progress display is settled before the cell's own output begins.
            if let Some(waiting) = waiting {
                let _ = waiting.join();
            }
            session.execute(&code, io)
        })
    }

    /// Completions at `cursor` (a character index).
    pub fn complete(&self, code: String, cursor: usize) -> oneshot::Receiver<CompletionOutcome> {
        self.submit(move |session| session.complete(&code, cursor))
    }

    /// Documentation for what is at `cursor` (a character index).
    pub fn inspect(&self, code: String, cursor: usize) -> oneshot::Receiver<InspectOutcome> {
        self.submit(move |session| session.inspect(&code, cursor))
    }

    /// Stops the child process for good (at shutdown).
    pub fn stop_child(&self) {
        let child = self.control.child.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(child) = child.as_ref() {
            let mut child = child.lock().unwrap_or_else(|e| e.into_inner());
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops the running cell, if any, by stopping the child process (Rust code cannot be
    /// unwound from outside). Returns whether a cell was running.
    pub fn interrupt(&self) -> bool {
        let running = self
            .control
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if !*running {
            return false;
        }
        self.control
            .interrupt_requested
            .store(true, Ordering::SeqCst);
        let child = self.control.child.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(child) = child.as_ref() {
            let mut child = child.lock().unwrap_or_else(|e| e.into_inner());
            if let Err(error) = child.kill() {
                tracing::warn!("could not stop the child process: {error}");
            }
        }
        true
    }
}
