//! The kernel's protocol behaviour over a fake evaluator and in-memory channels: busy/idle
//! around every request, what a cell publishes and in which order, aborting the queue after an
//! error with `stop_on_error`, interrupts. No sockets, no compiler: milliseconds.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use jupyter_protocol::{
    CompleteRequest, ExecuteRequest, ExecutionState, JupyterMessage, JupyterMessageContent,
    KernelInfoRequest, ReplyStatus,
};
use tokio::sync::{mpsc, oneshot, Notify};

use super::iopub::IopubEvent;
use super::shell::Shell;
use super::shell_loop::{self, ShellChannel};
use super::stdin::StdinBridge;
use super::{Evaluator, Interrupter, Iopub};
use crate::cell_error::ErrorName;
use crate::engine::{
    CellError, CellIo, CellOutcome, CellOutput, CompletionOutcome, InspectOutcome, StreamName,
};

/// Everything that happened, in order: IOPub messages and streams, and shell replies.
type Log = Arc<Mutex<Vec<String>>>;

/// Answers cells by their text: `print X` streams X, `fail` panics, `wait` runs until
/// interrupted, anything else evaluates to itself.
#[derive(Clone, Default)]
struct FakeEvaluator {
    executed: Arc<Mutex<Vec<String>>>,
    interrupts: Arc<Mutex<usize>>,
    wake: Arc<Notify>,
}

impl Evaluator for FakeEvaluator {
    fn execute(&self, code: String, io: CellIo) -> oneshot::Receiver<CellOutcome> {
        self.executed.lock().unwrap().push(code.clone());
        let (tx, rx) = oneshot::channel();
        let wake = Arc::clone(&self.wake);
        tokio::spawn(async move {
            let mut outcome = CellOutcome::default();
            if let Some(text) = code.strip_prefix("print ") {
                (io.output)(CellOutput::Stream(StreamName::Stdout, text.to_string()));
            } else if code == "fail" {
                outcome.error = Some(CellError::new(ErrorName::Panic, "boom"));
            } else if code == "wait" {
                wake.notified().await;
                outcome.error = Some(CellError::new(ErrorName::Interrupted, "stopped"));
            } else {
                outcome.data = [("text/plain".to_string(), code)].into();
            }
            let _ = tx.send(outcome);
        });
        rx
    }

    fn complete(&self, code: String, cursor: usize) -> oneshot::Receiver<CompletionOutcome> {
        let (tx, rx) = oneshot::channel();
        let _ = tx.send(CompletionOutcome {
            matches: vec![format!("{code}ros")],
            start: 0,
            end: cursor,
            candidates: Vec::new(),
        });
        rx
    }

    fn inspect(&self, _code: String, _cursor: usize) -> oneshot::Receiver<InspectOutcome> {
        let (tx, rx) = oneshot::channel();
        let _ = tx.send(InspectOutcome::default());
        rx
    }

    fn interrupt(&self) -> bool {
        *self.interrupts.lock().unwrap() += 1;
        self.wake.notify_one();
        true
    }
}

/// A shell socket in memory: requests from a queue, replies into the log.
struct TestChannel {
    requests: mpsc::UnboundedReceiver<JupyterMessage>,
    replies: mpsc::UnboundedSender<JupyterMessage>,
    log: Log,
}

impl ShellChannel for TestChannel {
    async fn next(&mut self) -> JupyterMessage {
        match self.requests.recv().await {
            Some(request) => request,
            None => std::future::pending().await,
        }
    }

    async fn next_within(&mut self, wait: Duration) -> Option<JupyterMessage> {
        tokio::time::timeout(wait, self.requests.recv())
            .await
            .ok()
            .flatten()
    }

    async fn send(&mut self, reply: JupyterMessage) {
        self.log
            .lock()
            .unwrap()
            .push(format!("reply {}", reply.message_type()));
        let _ = self.replies.send(reply);
    }
}

/// One IOPub event as a log line.
fn describe(event: &IopubEvent) -> Option<String> {
    match event {
        IopubEvent::Message(message) => Some(match &message.content {
            JupyterMessageContent::Status(status) => match status.execution_state {
                ExecutionState::Busy => "busy".to_string(),
                ExecutionState::Idle => "idle".to_string(),
                _ => "status".to_string(),
            },
            other => other.message_type().to_string(),
        }),
        IopubEvent::Stream { text, .. } => Some(format!("stream {text}")),
        IopubEvent::Flush(_) => None,
    }
}

/// A kernel's shell over the fake: send requests, read replies, read the log.
struct Kernel {
    evaluator: FakeEvaluator,
    requests: mpsc::UnboundedSender<JupyterMessage>,
    replies: mpsc::UnboundedReceiver<JupyterMessage>,
    log: Log,
}

impl Kernel {
    fn start() -> Kernel {
        let evaluator = FakeEvaluator::default();
        let log: Log = Arc::default();
        let (iopub, mut events) = Iopub::channel();
        let iopub_log = Arc::clone(&log);
        tokio::spawn(async move {
            while let Some(event) = events.recv().await {
                if let Some(line) = describe(&event) {
                    iopub_log.lock().unwrap().push(line);
                }
                if let IopubEvent::Flush(done) = event {
                    let _ = done.send(());
                }
            }
        });
        let (requests, requests_rx) = mpsc::unbounded_channel();
        let (replies_tx, replies) = mpsc::unbounded_channel();
        let channel = TestChannel {
            requests: requests_rx,
            replies: replies_tx,
            log: Arc::clone(&log),
        };
        let shell = Shell::new(evaluator.clone(), iopub.clone(), StdinBridge::unconnected());
        tokio::spawn(shell_loop::serve(shell, iopub, channel));
        Kernel {
            evaluator,
            requests,
            replies,
            log,
        }
    }

    fn send(&self, content: impl Into<JupyterMessageContent>) {
        self.requests
            .send(JupyterMessage::new(content, None))
            .unwrap();
    }

    async fn reply(&mut self) -> JupyterMessageContent {
        let reply = tokio::time::timeout(Duration::from_secs(5), self.replies.recv())
            .await
            .expect("a reply within 5 s")
            .expect("the shell is up");
        reply.content
    }

    /// The log once the request in flight went idle (each request ends with `idle`).
    async fn log_after_idles(&self, idles: usize) -> Vec<String> {
        for _ in 0..500 {
            let log = self.log.lock().unwrap().clone();
            if log.iter().filter(|line| *line == "idle").count() >= idles {
                return log;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        panic!("no idle: {:?}", self.log.lock().unwrap());
    }
}

/// The log's IOPub lines (replies travel on the shell socket, ordered against IOPub only by
/// the flush an execute request makes before its reply).
fn iopub_only(log: Vec<String>) -> Vec<String> {
    log.into_iter()
        .filter(|line| !line.starts_with("reply "))
        .collect()
}

fn execute(code: &str, stop_on_error: bool) -> ExecuteRequest {
    ExecuteRequest {
        stop_on_error,
        ..ExecuteRequest::new(code.to_string())
    }
}

fn status_of(reply: &JupyterMessageContent) -> ReplyStatus {
    match reply {
        JupyterMessageContent::ExecuteReply(reply) => reply.status.clone(),
        other => panic!("not an execute reply: {}", other.message_type()),
    }
}

#[tokio::test]
async fn a_cell_publishes_its_outputs_between_busy_and_idle_and_replies_before_idle() {
    let mut kernel = Kernel::start();
    kernel.send(execute("print hi", true));
    assert_eq!(status_of(&kernel.reply().await), ReplyStatus::Ok);
    kernel.send(execute("1 + 1", true));
    assert_eq!(status_of(&kernel.reply().await), ReplyStatus::Ok);
    let log = kernel.log_after_idles(2).await;
    assert_eq!(
        log,
        [
            "busy",
            "execute_input",
            "stream hi",
            "reply execute_reply",
            "idle",
            "busy",
            "execute_input",
            "execute_result",
            "reply execute_reply",
            "idle",
        ]
    );
}

#[tokio::test]
async fn every_request_kind_is_wrapped_in_busy_and_idle() {
    let mut kernel = Kernel::start();
    kernel.send(KernelInfoRequest {});
    assert!(matches!(
        kernel.reply().await,
        JupyterMessageContent::KernelInfoReply(_)
    ));
    kernel.send(CompleteRequest {
        code: "tch::Tensor::ze".into(),
        cursor_pos: 15,
    });
    let JupyterMessageContent::CompleteReply(complete) = kernel.reply().await else {
        panic!("not a complete reply");
    };
    assert_eq!(complete.matches, ["tch::Tensor::zeros"]);
    // Requests without output publish no flush, so only IOPub's own order is fixed.
    let log = iopub_only(kernel.log_after_idles(2).await);
    assert_eq!(log, ["busy", "idle", "busy", "idle"]);
}

#[tokio::test]
async fn a_failed_cell_with_stop_on_error_aborts_the_queued_cells_only() {
    let mut kernel = Kernel::start();
    // Run All: three cells queued at once; the first fails.
    kernel.send(execute("fail", true));
    kernel.send(execute("print never", true));
    kernel.send(KernelInfoRequest {});
    assert_eq!(status_of(&kernel.reply().await), ReplyStatus::Error);
    assert_eq!(status_of(&kernel.reply().await), ReplyStatus::Aborted);
    // What is not an execute request is still answered.
    assert!(matches!(
        kernel.reply().await,
        JupyterMessageContent::KernelInfoReply(_)
    ));
    // A cell sent after the queue drained runs.
    kernel.send(execute("print later", true));
    assert_eq!(status_of(&kernel.reply().await), ReplyStatus::Ok);
    assert_eq!(
        *kernel.evaluator.executed.lock().unwrap(),
        ["fail", "print later"]
    );
    let log = iopub_only(kernel.log_after_idles(4).await);
    assert_eq!(
        log,
        [
            "busy",
            "execute_input",
            "error",
            "idle",
            "busy",
            "idle",
            "busy",
            "idle",
            "busy",
            "execute_input",
            "stream later",
            "idle",
        ]
    );
}

#[tokio::test]
async fn without_stop_on_error_the_next_cell_runs() {
    let mut kernel = Kernel::start();
    kernel.send(execute("fail", false));
    kernel.send(execute("print next", false));
    assert_eq!(status_of(&kernel.reply().await), ReplyStatus::Error);
    assert_eq!(status_of(&kernel.reply().await), ReplyStatus::Ok);
    assert_eq!(kernel.evaluator.executed.lock().unwrap().len(), 2);
}

#[tokio::test]
async fn a_silent_cell_publishes_nothing_but_its_status() {
    let mut kernel = Kernel::start();
    kernel.send(ExecuteRequest {
        silent: true,
        ..execute("print quiet", true)
    });
    assert_eq!(status_of(&kernel.reply().await), ReplyStatus::Ok);
    let log = kernel.log_after_idles(1).await;
    assert_eq!(log, ["busy", "reply execute_reply", "idle"]);
}

#[tokio::test]
async fn an_interrupt_stops_the_running_cell_and_its_error_is_the_reply() {
    let mut kernel = Kernel::start();
    kernel.send(execute("wait", true));
    // Wait until the cell runs, then interrupt as the control channel does.
    while kernel.evaluator.executed.lock().unwrap().is_empty() {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let interrupter = Interrupter {
        engine: kernel.evaluator.clone(),
        stdin: StdinBridge::unconnected(),
    };
    interrupter.interrupt();
    let JupyterMessageContent::ExecuteReply(reply) = kernel.reply().await else {
        panic!("not an execute reply");
    };
    assert_eq!(reply.status, ReplyStatus::Error);
    assert_eq!(reply.error.unwrap().ename, "Interrupted");
    assert_eq!(*kernel.evaluator.interrupts.lock().unwrap(), 1);
    // The kernel goes on.
    kernel.send(execute("print after", true));
    assert_eq!(status_of(&kernel.reply().await), ReplyStatus::Ok);
}
