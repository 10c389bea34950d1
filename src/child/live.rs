//! The live view's samples: while a cell has run for more than a second, a thread of the child
//! sends the kernel the device's memory and the cell's progress a few times a second (as
//! [`CellMessage::Live`] lines), until the cell ends.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tchmem_wire::progress::{LiveSample, MemoryNow, RunState};
use tchmem_wire::CellMessage;

use super::runtime_slot;
use super::stdout_tap::LineWriter;

/// A cell shows no view before it has run this long.
pub const FIRST_SAMPLE_AFTER: Duration = Duration::from_secs(1);
/// Time between samples (at most four updates a second).
pub const SAMPLE_EVERY: Duration = Duration::from_millis(250);

/// The cell now running, as the sampling thread sees it.
#[derive(Default)]
struct Running {
    /// When the running cell's code started; `None` between cells.
    since: Option<Instant>,
}

/// Starts and stops sampling around each cell.
pub struct LiveSampler {
    shared: Arc<(Mutex<Running>, Condvar)>,
    writer: LineWriter,
    run: &'static RunState,
}

impl LiveSampler {
    /// Starts the sampling thread, which writes through `writer` and reads `run`.
    pub fn start(writer: LineWriter, run: &'static RunState) -> Self {
        let shared = Arc::new((Mutex::new(Running::default()), Condvar::new()));
        let thread_shared = Arc::clone(&shared);
        let thread_writer = writer.clone();
        let started = std::thread::Builder::new()
            .name("live-view".into())
            .spawn(move || sample_while_cells_run(&thread_shared, &thread_writer, run));
        if let Err(error) = started {
            eprintln!("tchmem child: no live view (cannot start its thread: {error})");
        }
        Self {
            shared,
            writer,
            run,
        }
    }

    /// A cell's code starts now.
    pub fn cell_started(&self) {
        lock(&self.shared.0).since = Some(Instant::now());
        self.shared.1.notify_all();
    }

    /// The cell's code has returned: a cell that showed a view gets a last sample (its final
    /// step and elapsed time); once this returns, no sample of it is written any more.
    pub fn cell_ended(&self) {
        // The sampler writes while holding the lock, so taking it waits out a sample in flight.
        let mut running = lock(&self.shared.0);
        if let Some(since) = running.since.take() {
            if since.elapsed() >= FIRST_SAMPLE_AFTER {
                send(&self.writer, self.run, since);
            }
        }
        self.shared.1.notify_all();
    }
}

fn sample_while_cells_run(shared: &(Mutex<Running>, Condvar), writer: &LineWriter, run: &RunState) {
    let (running, wake) = shared;
    let mut guard = lock(running);
    loop {
        let Some(since) = guard.since else {
            guard = wake.wait(guard).unwrap_or_else(|e| e.into_inner());
            continue;
        };
        let elapsed = since.elapsed();
        let next = if elapsed < FIRST_SAMPLE_AFTER {
            FIRST_SAMPLE_AFTER - elapsed
        } else {
            send(writer, run, since);
            SAMPLE_EVERY
        };
        guard = wake
            .wait_timeout(guard, next)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

/// Samples the running cell now and sends the sample to the kernel.
fn send(writer: &LineWriter, run: &RunState, since: Instant) {
    let sample = LiveSample {
        elapsed: since.elapsed().as_secs_f64(),
        memory: memory_now(),
        progress: run.progress(),
    };
    writer.write_lines(&[&CellMessage::Live(sample).to_line()]);
}

/// The device's memory, from the runtime's hook (none without the runtime or CUDA).
fn memory_now() -> Option<MemoryNow> {
    runtime_slot::sample_memory()
}

fn lock(mutex: &Mutex<Running>) -> MutexGuard<'_, Running> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}
