//! Moves the child's stdout and stderr lines to whoever runs the current cell, turning message
//! lines from the runtime and the child (see [`tchmem_wire::CellMessage`]) into rich outputs on
//! the way.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;

use tchmem_wire::progress::LiveSample;
use tchmem_wire::{CellMessage, Display, STDERR_SYNC_PREFIX};

use super::rich::{self, Block, Trailing};

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
    /// A sample of the running cell, for the live view (see `cells::live`).
    Live(LiveSample),
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
    /// evcxr rich output the cell printed last, not shown yet (see [`super::rich`]).
    pub trailing: Trailing,
}

/// Receives a running cell's outputs, in order.
pub type OutputSink = Arc<dyn Fn(CellOutput) + Send + Sync>;

#[derive(Default)]
struct Current {
    sink: Option<OutputSink>,
    leftovers: Leftovers,
}

impl Current {
    fn show(&self, output: CellOutput) {
        match &self.sink {
            Some(sink) => sink(output),
            None => tracing::debug!("output outside a cell: {output:?}"),
        }
    }

    fn show_blocks(&self, blocks: Vec<Block>) {
        for block in blocks {
            self.show(CellOutput::Display(rich::display(block)));
        }
    }
}

/// Asks the pump to answer once every line it took before has been delivered.
struct Flush(crossbeam_channel::Sender<()>);

/// One thread that pumps evcxr's stdout and stderr channels into the current sink.
///
/// The pump never holds the sink lock while it waits for a line, only while it delivers one.
/// (An earlier design kept the lock across a short poll, with one thread per channel: a mutex
/// promises no fairness, and on the 16-core H200 one thread re-took the lock again and again
/// while another slept on it for minutes, which stalled cells with every process idle.)
pub struct StreamPump {
    current: Arc<Mutex<Current>>,
    stderr_synced: Receiver<String>,
    flush: crossbeam_channel::Sender<Flush>,
}

impl StreamPump {
    /// Starts pumping evcxr's stdout and stderr receivers.
    pub fn start(stdout: Receiver<String>, stderr: Receiver<String>) -> Self {
        let current = Arc::new(Mutex::new(Current::default()));
        let (synced_tx, stderr_synced) = crossbeam_channel::unbounded();
        let (flush, flushes) = crossbeam_channel::unbounded::<Flush>();
        let pumped = Arc::clone(&current);
        std::thread::Builder::new()
            .name("stream-pump".into())
            .spawn(move || pump(stdout, stderr, flushes, &pumped, &synced_tx))
            .expect("spawning the stream pump thread");
        Self {
            current,
            stderr_synced,
            flush,
        }
    }

    /// Sends stream output to `sink` until [`StreamPump::detach`]. `ends_in_value`: the cell
    /// ends in an expression with a value to show, so evcxr rich output it prints last is held
    /// back as its possible result (see [`super::rich`]).
    pub fn attach(&self, sink: OutputSink, ends_in_value: bool) {
        let mut current = lock(&self.current);
        current.sink = Some(sink);
        current.leftovers = Leftovers {
            trailing: Trailing::new(ends_in_value),
            ..Default::default()
        };
    }

    /// Waits until the stderr line carrying `token` has passed (or `timeout`) and every line the
    /// pump already took is delivered, then stops sending output to the sink. Returns the cell's
    /// stderr, panics and held rich output. Stdout needs no marker: evcxr returns only after its stdout channel is
    /// empty, so the flush covers its last line.
    pub fn detach(&self, token: Option<&str>, timeout: Duration) -> Leftovers {
        let deadline = Instant::now() + timeout;
        if let Some(token) = token {
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
        let (done, flushed) = crossbeam_channel::bounded(1);
        if self.flush.send(Flush(done)).is_ok() {
            let _ = flushed.recv_timeout(deadline.saturating_duration_since(Instant::now()));
        }
        let mut current = lock(&self.current);
        current.sink = None;
        std::mem::take(&mut current.leftovers)
    }
}

/// The pump thread: takes lines from either channel as they come (each channel in order) and
/// delivers them; answers flushes; ends when the engine drops its handle.
fn pump(
    stdout: Receiver<String>,
    stderr: Receiver<String>,
    flushes: Receiver<Flush>,
    current: &Mutex<Current>,
    synced: &crossbeam_channel::Sender<String>,
) {
    let closed = crossbeam_channel::never::<String>();
    let (mut stdout_open, mut stderr_open) = (true, true);
    loop {
        let (name, received) = crossbeam_channel::select! {
            recv(if stdout_open { &stdout } else { &closed }) -> line => (StreamName::Stdout, line),
            recv(if stderr_open { &stderr } else { &closed }) -> line => (StreamName::Stderr, line),
            recv(flushes) -> flush => match flush {
                Ok(Flush(done)) => {
                    let _ = done.send(());
                    continue;
                }
                Err(_) => return,
            },
        };
        let Ok(line) = received else {
            match name {
                StreamName::Stdout => stdout_open = false,
                StreamName::Stderr => stderr_open = false,
            }
            continue;
        };
        // Take the rest of what this stream already holds in one go: select! picks among ready
        // channels at random, which interleaved a burst of stdout with a later burst of stderr
        // line by line (seen on the H200) and broke the frontend's batches into single lines.
        let source = match name {
            StreamName::Stdout => &stdout,
            StreamName::Stderr => &stderr,
        };
        let mut current = lock(current);
        let mut next = Some(line);
        while let Some(line) = next.take() {
            // The child writes the marker on a line of its own, but a cell whose stderr ended
            // without a newline has its last text on the marker's line, before it.
            match line.find(STDERR_SYNC_PREFIX) {
                Some(at) if name == StreamName::Stderr => {
                    let token = line[at + STDERR_SYNC_PREFIX.len()..].to_string();
                    if at > 0 {
                        deliver(&mut current, name, line[..at].to_string());
                    }
                    let _ = synced.send(token);
                }
                _ => deliver(&mut current, name, line),
            }
            next = source.try_recv().ok();
        }
    }
}

fn deliver(current: &mut Current, name: StreamName, line: String) {
    if name == StreamName::Stderr {
        keep_tail(&mut current.leftovers.stderr, &line);
    }
    match classify(name, line) {
        Classified::Output(output) => {
            // Output after held rich output: that was not the cell's last, so not its value. A
            // live-view sample is not the cell's output (the last one comes after the value).
            if name == StreamName::Stdout && !matches!(output, CellOutput::Live(_)) {
                let held = current.leftovers.trailing.release();
                current.show_blocks(held);
            }
            current.show(output);
        }
        Classified::Content(block) => {
            let shown = current.leftovers.trailing.block(block);
            current.show_blocks(shown);
        }
        Classified::Panic(panic) => current.leftovers.panics.push(panic),
    }
}

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
    Content(Block),
    Panic(PanicReport),
}

/// A message line becomes what it says; anything else (a malformed one too) stays text.
fn classify(name: StreamName, line: String) -> Classified {
    if name == StreamName::Stdout {
        if let Some(Ok(message)) = CellMessage::from_line(&line) {
            return match message {
                CellMessage::Display(mut display) => {
                    rich::with_svg_image(&mut display.data);
                    Classified::Output(CellOutput::Display(display))
                }
                CellMessage::ClearOutput { wait } => {
                    Classified::Output(CellOutput::ClearOutput { wait })
                }
                CellMessage::Live(sample) => Classified::Output(CellOutput::Live(sample)),
                CellMessage::Content { mime, content } => {
                    Classified::Content(Block { mime, content })
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::StreamPump;
    use tchmem_wire::STDERR_SYNC_PREFIX;

    /// The engine must get the sink lock at once, every time, while the pump waits for lines
    /// (it once waited minutes on a 16-core machine).
    #[test]
    fn the_engine_gets_the_sink_promptly_while_the_pump_waits() {
        let (_stdout_tx, stdout) = crossbeam_channel::unbounded::<String>();
        let (_stderr_tx, stderr) = crossbeam_channel::unbounded::<String>();
        let pump = StreamPump::start(stdout, stderr);
        let mut slowest = Duration::ZERO;
        for _ in 0..300 {
            let began = Instant::now();
            pump.attach(Arc::new(|_| {}), false);
            slowest = slowest.max(began.elapsed());
        }
        assert!(
            slowest < Duration::from_millis(500),
            "slowest claim took {slowest:?}"
        );
    }

    /// Polls `done` until it holds or 5 s have passed (the pump delivers on its own thread).
    fn wait_until(done: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !done() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Attaches a sink that keeps the stream text it is sent, and returns that text.
    fn attach_text(pump: &StreamPump) -> Arc<std::sync::Mutex<String>> {
        let seen = Arc::new(std::sync::Mutex::new(String::new()));
        let sink_seen = Arc::clone(&seen);
        pump.attach(
            Arc::new(move |output| {
                if let super::CellOutput::Stream(_, text) = output {
                    sink_seen.lock().unwrap().push_str(&text);
                }
            }),
            false,
        );
        seen
    }

    #[test]
    fn lines_reach_the_attached_sink_in_order() {
        let (stdout_tx, stdout) = crossbeam_channel::unbounded::<String>();
        let (_stderr_tx, stderr) = crossbeam_channel::unbounded::<String>();
        let pump = StreamPump::start(stdout, stderr);
        let seen = attach_text(&pump);
        for i in 0..50 {
            stdout_tx.send(format!("line {i}")).unwrap();
        }
        wait_until(|| seen.lock().unwrap().lines().count() >= 50);
        let expected: String = (0..50).map(|i| format!("line {i}\n")).collect();
        assert_eq!(*seen.lock().unwrap(), expected);
    }

    #[test]
    fn the_marker_after_stderr_without_a_final_newline_still_ends_the_wait() {
        let (_stdout_tx, stdout) = crossbeam_channel::unbounded::<String>();
        let (stderr_tx, stderr) = crossbeam_channel::unbounded::<String>();
        let pump = StreamPump::start(stdout, stderr);
        let seen = attach_text(&pump);
        stderr_tx
            .send(format!("50% done{STDERR_SYNC_PREFIX}7-1"))
            .unwrap();
        let started = Instant::now();
        let leftovers = pump.detach(Some("7-1"), Duration::from_secs(5));
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "waited for the timeout"
        );
        assert_eq!(*seen.lock().unwrap(), "50% done\n");
        assert_eq!(leftovers.stderr, "50% done\n");
    }

    /// Bursts already waiting on both channels come out as one run per stream, not line by
    /// line alternating (which split the frontend's batches on the H200).
    #[test]
    fn waiting_bursts_are_delivered_stream_by_stream() {
        let (stdout_tx, stdout) = crossbeam_channel::unbounded::<String>();
        let (stderr_tx, stderr) = crossbeam_channel::unbounded::<String>();
        let pump = StreamPump::start(stdout, stderr);
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink_seen = Arc::clone(&seen);
        {
            // Holding the sink lock, the pump can take at most one line before both bursts wait.
            let mut current = super::lock(&pump.current);
            for i in 0..200 {
                stdout_tx.send(format!("out {i}")).unwrap();
            }
            for i in 0..50 {
                stderr_tx.send(format!("err {i}")).unwrap();
            }
            current.sink = Some(Arc::new(move |output| {
                if let super::CellOutput::Stream(name, _) = output {
                    sink_seen.lock().unwrap().push(name);
                }
            }));
        }
        wait_until(|| seen.lock().unwrap().len() >= 250);
        let names = seen.lock().unwrap().clone();
        assert_eq!(names.len(), 250);
        let switches = names.windows(2).filter(|w| w[0] != w[1]).count();
        assert!(
            switches <= 1,
            "{switches} switches between stdout and stderr"
        );
    }

    /// Runs `lines` through a pump attached with `ends_in_value`; returns what the sink saw
    /// (streams as text, displays by their first MIME type) and the blocks held at detach.
    fn pumped(lines: &[String], ends_in_value: bool) -> (Vec<String>, Vec<super::Block>) {
        let (stdout_tx, stdout) = crossbeam_channel::unbounded::<String>();
        let (_stderr_tx, stderr) = crossbeam_channel::unbounded::<String>();
        let pump = StreamPump::start(stdout, stderr);
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink_seen = Arc::clone(&seen);
        pump.attach(
            Arc::new(move |output| {
                let text = match output {
                    super::CellOutput::Stream(_, text) => text,
                    super::CellOutput::Display(display) => {
                        let (mime, value) = display
                            .data
                            .iter()
                            .find(|(mime, _)| *mime != "text/plain")
                            .unwrap();
                        format!("{mime}: {}", value.as_str().unwrap_or_default())
                    }
                    super::CellOutput::ClearOutput { .. } => "clear".into(),
                    super::CellOutput::Live(sample) => format!("live: {}", sample.elapsed),
                };
                sink_seen.lock().unwrap().push(text);
            }),
            ends_in_value,
        );
        for line in lines {
            stdout_tx.send(line.clone()).unwrap();
        }
        while !stdout_tx.is_empty() {
            std::thread::yield_now();
        }
        let leftovers = pump.detach(None, Duration::from_secs(5));
        let (shown, result) = leftovers.trailing.finish(true);
        assert!(shown.is_empty());
        let seen = seen.lock().unwrap().clone();
        (seen, result)
    }

    fn content(mime: &str, content: &str) -> String {
        tchmem_wire::CellMessage::Content {
            mime: mime.into(),
            content: content.into(),
        }
        .to_line()
    }

    #[test]
    fn evcxr_blocks_become_displays_between_the_lines_around_them() {
        let lines = [
            "before".to_string(),
            content("text/html", "<b>a</b>"),
            "after".to_string(),
            content("text/html", "<b>b</b>"),
        ];
        let (seen, result) = pumped(&lines, false);
        assert_eq!(
            seen,
            [
                "before\n",
                "text/html: <b>a</b>",
                "after\n",
                "text/html: <b>b</b>"
            ]
        );
        assert!(result.is_empty());
        // In a cell ending in a value, the last block is held back as the result.
        let (seen, result) = pumped(&lines, true);
        assert_eq!(seen, ["before\n", "text/html: <b>a</b>", "after\n"]);
        assert_eq!(result.len(), 1);
        assert_eq!(result[0].content, "<b>b</b>");
    }

    #[test]
    fn a_live_sample_after_the_value_leaves_it_the_value() {
        // The child sends a last sample when a long cell ends, after its value was printed.
        let sample = tchmem_wire::CellMessage::Live(Default::default()).to_line();
        let lines = [content("text/html", "<b>value</b>"), sample];
        let (seen, result) = pumped(&lines, true);
        assert_eq!(seen, ["live: 0"]);
        assert_eq!(result.len(), 1, "still the cell's value");
    }

    #[test]
    fn a_line_sent_before_detach_reaches_the_cell_that_printed_it() {
        for _ in 0..30 {
            let (stdout_tx, stdout) = crossbeam_channel::unbounded::<String>();
            let (_stderr_tx, stderr) = crossbeam_channel::unbounded::<String>();
            let pump = StreamPump::start(stdout, stderr);
            let seen = Arc::new(std::sync::Mutex::new(0));
            let counter = Arc::clone(&seen);
            pump.attach(Arc::new(move |_| *counter.lock().unwrap() += 1), false);
            stdout_tx.send("last line".into()).unwrap();
            // As evcxr does before it returns: wait until the channel is empty.
            while !stdout_tx.is_empty() {
                std::thread::yield_now();
            }
            pump.detach(None, Duration::from_secs(5));
            assert_eq!(*seen.lock().unwrap(), 1);
        }
    }
}
