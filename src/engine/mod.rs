//! The evaluation engine: an evcxr `CommandContext` on a thread of its own.
//!
//! Everything that touches evcxr runs on that thread, one job at a time, in arrival order; the
//! handle ([`Engine`]) is cheap to clone and hands results back through oneshot channels, so the
//! async kernel and the synchronous notebook runner drive it the same way. Interrupts bypass the
//! queue (see [`Engine::interrupt`]).

mod start_progress;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use tokio::sync::oneshot;

pub use crate::cells::live::DISPLAY_ID_PREFIX as LIVE_DISPLAY_ID_PREFIX;
pub use crate::session::workdir;
pub use crate::session::{
    completion_metadata, CellError, CellIo, CellOutcome, CellOutput, CompletionOutcome,
    EngineConfig, InputFn, InspectOutcome, OutputSink, StreamName, TCH_VERSION,
};
pub use start_progress::{Progress, Stage};

use crate::cells::Cells;
use crate::session::PathCompletions;
use crate::session::{Control, Session};
use start_progress::Startup;

/// How long a completion waits for the analysis when the path's members are remembered: well
/// under the second after which JupyterLab drops an answer.
const ANALYSIS_PATIENCE: Duration = Duration::from_millis(500);

/// What the engine thread works on: the cells layer over the evcxr session.
type Notebook = Cells<Session>;

type Job = Box<dyn FnOnce(&mut Notebook) + Send>;

/// Handle to the engine thread.
#[derive(Clone)]
pub struct Engine {
    jobs: mpsc::Sender<Job>,
    control: Arc<Control>,
    startup: Arc<Startup>,
    /// Path completions remembered from the code analysis: the answer while the engine thread
    /// is busy (starting, loading the analysis, running a cell).
    paths: Arc<PathCompletions>,
    /// The engine thread waits for a job (and the analysis has loaded).
    idle: Arc<AtomicBool>,
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
        // Remembered per prelude, in a file every kernel of the machine shares: a kernel without
        // tch (no libtorch, no runtime crate) keeps its own in memory, or it would replace the
        // tch paths the next kernel's first Tab answers from.
        let prelude = config.prelude();
        let paths = Arc::new(PathCompletions::load(
            prelude.as_ref().and(config.workdir.parent()),
            &prelude.unwrap_or_default(),
        ));
        let thread_paths = Arc::clone(&paths);
        let idle = Arc::new(AtomicBool::new(false));
        let thread_idle = Arc::clone(&idle);
        std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || {
                let snapshots = crate::cells::snapshot_dir(&config.workdir);
                let session = Session::start(config, Arc::clone(&thread_control));
                thread_startup.finish(session.prelude_loaded());
                let mut session = Cells::new(session, snapshots);
                // The code analysis loads the crate graph on its first request (5 s after a
                // start, measured): do that at the first moment with nothing queued, so that the
                // user's first completion answers within a frontend's timeout.
                let mut warmed = !warm_up;
                loop {
                    let job = if warmed {
                        thread_idle.store(true, Ordering::SeqCst);
                        let job = queue.recv().ok();
                        thread_idle.store(false, Ordering::SeqCst);
                        job
                    } else {
                        match queue.try_recv() {
                            Ok(job) => Some(job),
                            Err(mpsc::TryRecvError::Empty) => {
                                let _ =
                                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                        session.runner_mut().warm_up_analysis(&thread_paths)
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
                        thread_control.set_running(false);
                    }
                }
            })
            .expect("spawning the engine thread");
        Engine {
            jobs,
            control,
            startup,
            paths,
            idle,
        }
    }

    /// Calls `report` every `every` while the engine starts (compiles or loads the prelude);
    /// returns once it is ready, with how far the start went.
    pub fn report_start(&self, every: Duration, report: impl FnMut(&Progress)) -> Progress {
        self.startup.report_until_ready(every, report)
    }

    fn submit<T: Send + 'static>(
        &self,
        job: impl FnOnce(&mut Notebook) -> T + Send + 'static,
    ) -> oneshot::Receiver<T> {
        let (tx, rx) = oneshot::channel();
        self.send_job(Box::new(move |session| {
            let _ = tx.send(job(session));
        }));
        rx
    }

    /// Queues `job` on the engine thread.
    fn send_job(&self, job: Job) {
        if self.jobs.send(job).is_err() {
            tracing::error!("the engine thread has stopped");
        }
    }

    /// Runs a cell. Its outputs go to `io` while it runs. A cell that comes while the engine
    /// still starts shows the start's progress, updated in place, until it runs.
    pub fn execute(&self, code: String, io: CellIo) -> oneshot::Receiver<CellOutcome> {
        let waiting = (self.startup.stage() == Stage::Starting).then(|| {
            let startup = Arc::clone(&self.startup);
            let output = Arc::clone(&io.output);
            std::thread::spawn(move || start_progress::show_until_ready(&startup, &output))
        });
        self.submit(move |session| {
            // The progress display is settled before the cell's own output begins.
            if let Some(waiting) = waiting {
                let _ = waiting.join();
            }
            session.execute(&code, io)
        })
    }

    /// Completions at `cursor` (a character index). A path seen before (`tch::Tensor::ze`) is
    /// answered from its remembered members at once while the engine thread is busy, and when
    /// the analysis takes longer than [`ANALYSIS_PATIENCE`] (it may be loading, or re-reading the
    /// cells): a frontend drops a late answer. A path of tch or std not seen before is
    /// remembered after the analysis answered it.
    pub fn complete(&self, code: String, cursor: usize) -> oneshot::Receiver<CompletionOutcome> {
        let remembered = self.paths.answer(&code, cursor);
        if !self.idle.load(Ordering::SeqCst) {
            if let Some(answer) = remembered {
                let (tx, rx) = oneshot::channel();
                let _ = tx.send(answer);
                return rx;
            }
        }
        let unseen = self.paths.unseen_path(&code, cursor);
        let answer = match remembered {
            None => self.submit(move |session| session.runner_mut().complete(&code, cursor)),
            Some(fallback) => {
                let (found_tx, found_rx) = mpsc::channel();
                self.send_job(Box::new(move |session| {
                    let _ = found_tx.send(session.runner_mut().complete(&code, cursor));
                }));
                answer_in_time(found_rx, fallback, ANALYSIS_PATIENCE)
            }
        };
        if let Some(path) = unseen {
            let paths = Arc::clone(&self.paths);
            self.submit(move |session| session.runner_mut().remember_path(&path, &paths));
        }
        answer
    }

    /// Asks the code analysis for the paths a start remembers (`tchmem prepare`: the first
    /// start after set-up then answers its first completion from them).
    pub fn remember_paths(&self) -> oneshot::Receiver<()> {
        let paths = Arc::clone(&self.paths);
        self.submit(move |session| session.runner_mut().warm_up_analysis(&paths))
    }

    /// Documentation for what is at `cursor` (a character index).
    pub fn inspect(&self, code: String, cursor: usize) -> oneshot::Receiver<InspectOutcome> {
        self.submit(move |session| session.runner_mut().inspect(&code, cursor))
    }

    /// Stops the child process for good (at shutdown).
    pub fn stop_child(&self) {
        self.control.with_child(|child| {
            let _ = child.kill();
            let _ = child.wait();
        });
    }

    /// Interrupts the running cell, if any: it stops at its next loop boundary with every
    /// variable kept, or its process is stopped after the grace period (see
    /// `session::control`). Returns whether a cell was running.
    pub fn interrupt(&self) -> bool {
        self.control.interrupt(crate::session::interrupt_grace())
    }
}

/// The analysis' answer from `found`, or `remembered` if it does not come within `patience`.
fn answer_in_time(
    found: mpsc::Receiver<CompletionOutcome>,
    remembered: CompletionOutcome,
    patience: Duration,
) -> oneshot::Receiver<CompletionOutcome> {
    let (tx, rx) = oneshot::channel();
    std::thread::spawn(move || {
        let answer = found.recv_timeout(patience).unwrap_or_else(|_| {
            tracing::debug!("the analysis is slow: answered from remembered members");
            remembered
        });
        let _ = tx.send(answer);
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(name: &str) -> CompletionOutcome {
        CompletionOutcome {
            matches: vec![name.to_string()],
            ..Default::default()
        }
    }

    /// Sends `name` after `delay`, as an engine thread busy for that long would.
    fn analysis_answering(name: &str, delay: Duration) -> mpsc::Receiver<CompletionOutcome> {
        let (tx, rx) = mpsc::channel();
        let answer = outcome(name);
        std::thread::spawn(move || {
            std::thread::sleep(delay);
            let _ = tx.send(answer);
        });
        rx
    }

    #[test]
    fn a_quick_analysis_answers_and_a_slow_one_gives_way_to_the_remembered_members() {
        let patience = Duration::from_millis(200);
        let quick = analysis_answering("analysis", Duration::ZERO);
        let answer = answer_in_time(quick, outcome("remembered"), patience);
        assert_eq!(answer.blocking_recv().unwrap().matches, ["analysis"]);

        let slow = analysis_answering("analysis", Duration::from_secs(2));
        let started = std::time::Instant::now();
        let answer = answer_in_time(slow, outcome("remembered"), patience);
        assert_eq!(answer.blocking_recv().unwrap().matches, ["remembered"]);
        assert!(started.elapsed() < Duration::from_secs(1));
    }
}
