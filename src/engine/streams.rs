//! Moves the child's stdout and stderr lines to whoever runs the current cell, turning message
//! lines from the runtime (see [`tchmem_wire::CellMessage`]) into rich outputs on the way.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError};

use tchmem_wire::{CellMessage, Display, STDERR_SYNC_PREFIX};

/// Which stream a piece of text came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamName {
    /// The cell's stdout.
    Stdout,
    /// The cell's stderr.
    Stderr,
}

/// Something a cell produced while running.
#[derive(Debug)]
pub enum CellOutput {
    /// One line of stream text, with its newline.
    Stream(StreamName, String),
    /// A rich display (or an update of one).
    Display(Display),
    /// Clear what the cell showed so far.
    ClearOutput {
        /// Wait for the next output before clearing.
        wait: bool,
    },
}

/// A panic reported by the runtime's hook.
#[derive(Debug, Clone)]
pub struct PanicReport {
    /// The thread that panicked.
    pub thread: String,
    /// Its message.
    pub message: String,
    /// Where, when known.
    pub location: Option<String>,
}

/// What a cell left behind besides its outputs.
#[derive(Debug, Default)]
pub struct Leftovers {
    /// Everything it wrote to stderr.
    pub stderr: String,
    /// Panics reported by the runtime's hook, in order.
    pub panics: Vec<PanicReport>,
}

/// Receives a running cell's outputs, in order.
pub type OutputSink = Arc<dyn Fn(CellOutput) + Send + Sync>;

#[derive(Default)]
struct Current {
    sink: Option<OutputSink>,
    leftovers: Leftovers,
}

/// Two threads that pump evcxr's output channels into the current sink.
pub struct StreamPump {
    current: Arc<Mutex<Current>>,
    stderr_synced: Receiver<String>,
}

/// How long a pump waits on its channel before letting go of the sink lock.
const POLL: Duration = Duration::from_millis(5);

impl StreamPump {
    /// Starts pumping evcxr's stdout and stderr receivers.
    pub fn start(stdout: Receiver<String>, stderr: Receiver<String>) -> Self {
        let current = Arc::new(Mutex::new(Current::default()));
        let (synced_tx, stderr_synced) = crossbeam_channel::unbounded();
        for (name, rx) in [(StreamName::Stdout, stdout), (StreamName::Stderr, stderr)] {
            let current = Arc::clone(&current);
            let synced_tx = synced_tx.clone();
            std::thread::Builder::new()
                .name(format!("{name:?}-pump").to_lowercase())
                .spawn(move || loop {
                    // The lock is held while waiting, so that once the engine holds it no line
                    // is half-way between the channel and the sink.
                    let mut guard = lock(&current);
                    match rx.recv_timeout(POLL) {
                        Ok(line) => {
                            if let Some(token) = line.strip_prefix(STDERR_SYNC_PREFIX) {
                                let _ = synced_tx.send(token.to_string());
                                continue;
                            }
                            if name == StreamName::Stderr {
                                keep_tail(&mut guard.leftovers.stderr, &line);
                            }
                            let output = match classify(name, line) {
                                Classified::Output(output) => output,
                                Classified::Panic(panic) => {
                                    guard.leftovers.panics.push(panic);
                                    continue;
                                }
                            };
                            match &guard.sink {
                                Some(sink) => sink(output),
                                None => tracing::debug!("output outside a cell: {output:?}"),
                            }
                        }
                        Err(RecvTimeoutError::Timeout) => {
                            drop(guard);
                            std::thread::yield_now();
                        }
                        Err(RecvTimeoutError::Disconnected) => return,
                    }
                })
                .expect("spawning a stream pump thread");
        }
        Self {
            current,
            stderr_synced,
        }
    }

    /// Sends stream output to `sink` until [`StreamPump::detach`].
    pub fn attach(&self, sink: OutputSink) {
        let mut current = lock(&self.current);
        current.sink = Some(sink);
        current.leftovers = Leftovers::default();
    }

    /// Waits until the stderr line carrying `token` has passed (or `timeout`), then stops sending
    /// output to the sink. Returns the cell's stderr and panics. Stdout needs no marker: evcxr returns only
    /// after its stdout channel is empty, and the pump holds the lock until a line is delivered.
    pub fn detach(&self, token: Option<&str>, timeout: Duration) -> Leftovers {
        if let Some(token) = token {
            let deadline = Instant::now() + timeout;
            while let Ok(seen) = self
                .stderr_synced
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                if seen == token {
                    break;
                }
            }
        } else {
            // No marker (the child died or nothing ran): give stderr a moment to drain.
            std::thread::sleep(Duration::from_millis(100));
        }
        let mut current = lock(&self.current);
        current.sink = None;
        std::mem::take(&mut current.leftovers)
    }
}

/// How much of a cell's stderr is kept to find a panic message in (its end).
const STDERR_KEPT: usize = 64 * 1024;

/// Appends a line to `kept`, dropping the oldest text beyond [`STDERR_KEPT`].
fn keep_tail(kept: &mut String, line: &str) {
    kept.push_str(line);
    kept.push('\n');
    if kept.len() > STDERR_KEPT {
        let mut cut = kept.len() - STDERR_KEPT;
        while !kept.is_char_boundary(cut) {
            cut += 1;
        }
        kept.drain(..cut);
    }
}

enum Classified {
    Output(CellOutput),
    Panic(PanicReport),
}

/// A message line becomes what it says; anything else (a malformed one too) stays text.
fn classify(name: StreamName, line: String) -> Classified {
    if name == StreamName::Stdout {
        if let Some(Ok(message)) = CellMessage::from_line(&line) {
            return match message {
                CellMessage::Display(display) => Classified::Output(CellOutput::Display(display)),
                CellMessage::ClearOutput { wait } => {
                    Classified::Output(CellOutput::ClearOutput { wait })
                }
                CellMessage::Panic {
                    thread,
                    message,
                    location,
                } => Classified::Panic(PanicReport {
                    thread,
                    message,
                    location,
                }),
            };
        }
    }
    Classified::Output(CellOutput::Stream(name, line + "\n"))
}

fn lock(current: &Mutex<Current>) -> MutexGuard<'_, Current> {
    current.lock().unwrap_or_else(|e| e.into_inner())
}
