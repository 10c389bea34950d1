//! The evaluation engine: an evcxr `CommandContext` on a thread of its own.
//!
//! Everything that touches evcxr runs on that thread, one job at a time, in arrival order; the
//! handle ([`Engine`]) is cheap to clone and hands results back through oneshot channels, so the
//! async kernel and the synchronous notebook runner drive it the same way. Interrupts bypass the
//! queue (see [`Engine::interrupt`]).

mod errors;
mod infer;
mod optimize;
mod positions;
mod session;
mod setup;
mod streams;
pub mod workdir;

use std::collections::BTreeMap;
use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use tokio::sync::oneshot;

pub use errors::CellError;
pub use setup::{EngineConfig, TCH_VERSION};
pub use streams::{CellOutput, OutputSink, StreamName};

use session::Session;
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
}

impl CellOutcome {
    /// Takes the cell's result as a Jupyter bundle (JSON MIME types as JSON).
    pub fn take_result(&mut self) -> serde_json::Map<String, serde_json::Value> {
        std::mem::take(&mut self.data)
            .into_iter()
            .map(|(mime, text)| {
                let value = tchmem_wire::bundle_value(&mime, &text);
                (mime, value)
            })
            .collect()
    }
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
}

impl Engine {
    /// Starts the engine thread. It creates the evcxr context and compiles the prelude (tch and
    /// the runtime crate) before taking jobs, so the first jobs wait for that.
    pub fn start(config: EngineConfig) -> Engine {
        let (jobs, queue) = mpsc::channel::<Job>();
        let control = Arc::new(Control::default());
        let thread_control = Arc::clone(&control);
        std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || {
                let mut session = Session::start(config, Arc::clone(&thread_control));
                for job in queue {
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
        Engine { jobs, control }
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

    /// Runs a cell. Its outputs go to `io` while it runs.
    pub fn execute(&self, code: String, io: CellIo) -> oneshot::Receiver<CellOutcome> {
        self.submit(move |session| session.execute(&code, io))
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
