//! What the job thread shares with the engine's handle: reachable while a cell runs, so that an
//! interrupt can stop it. An interrupt first asks the cell to stop at its next loop boundary
//! (SIGUSR1 to the child, see `child::interrupt`), which keeps every variable; the child is
//! stopped only when no boundary comes within the grace period, or at a second interrupt.

use std::process::Child;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The environment variable that sets the grace period, in seconds.
pub const GRACE_ENV: &str = "TCHMEM_INTERRUPT_GRACE";

/// How long an interrupted cell may run on to its next loop boundary, by default.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(5);

/// Why the process running cells was stopped by an interrupt.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Stop {
    /// No loop boundary came within the grace period.
    NoBoundary(Duration),
    /// A second interrupt came during the grace period.
    SecondInterrupt,
    /// Cells cannot be stopped at a boundary here (no runtime in the child).
    NoBoundaries,
}

/// State shared with the engine thread that must be reachable while it is busy.
#[derive(Default)]
pub struct Control {
    /// A cell is running. A mutex, not an atomic: interrupt checks it and signals the child
    /// while holding it, so a cell that just finished cannot lose its process to a late
    /// interrupt.
    pub running: Mutex<bool>,
    /// Set by an interrupt; the cell that ends next reports it.
    pub interrupt_requested: AtomicBool,
    /// Counts cell runs: a grace period ends only the run it began in.
    runs: AtomicU64,
    /// The child stops at loop boundaries (the runtime is loaded in it).
    pub boundaries: AtomicBool,
    /// Why the child was stopped, when an interrupt stopped it.
    stop: Mutex<Option<Stop>>,
    /// The process running cells (evcxr's handle), once it exists.
    child: Mutex<Option<Arc<Mutex<Child>>>>,
}

impl Control {
    /// Calls `f` with the child process now running cells, if there is one (locks tolerate
    /// poison: a panic elsewhere must not keep an interrupt from the child).
    pub fn with_child<T>(&self, f: impl FnOnce(&mut Child) -> T) -> Option<T> {
        let child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        let mut child = child.as_ref()?.lock().unwrap_or_else(|e| e.into_inner());
        Some(f(&mut child))
    }

    /// The id of the child process now running cells.
    pub fn child_pid(&self) -> Option<u32> {
        self.with_child(|child| child.id())
    }

    /// Makes `child` the process that interrupts reach.
    pub fn set_child(&self, child: Arc<Mutex<Child>>) {
        *self.child.lock().unwrap_or_else(|e| e.into_inner()) = Some(child);
    }

    /// Marks whether a cell is running; a new run forgets the last one's interrupt.
    pub fn set_running(&self, running: bool) {
        let mut guard = self.running.lock().unwrap_or_else(|e| e.into_inner());
        if running {
            self.runs.fetch_add(1, Ordering::SeqCst);
            self.interrupt_requested.store(false, Ordering::SeqCst);
            *self.stop.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
        *guard = running;
    }

    /// Why an interrupt stopped the child in the last run, if it did.
    pub fn stop_reason(&self) -> Option<Stop> {
        *self.stop.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Interrupts the running cell (see the module's comment); `grace` is how long it may run
    /// on to a loop boundary. Returns whether a cell was running.
    pub fn interrupt(self: &Arc<Self>, grace: Duration) -> bool {
        let running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        if !*running {
            return false;
        }
        let again = self.interrupt_requested.swap(true, Ordering::SeqCst);
        if again {
            self.kill(Stop::SecondInterrupt);
        } else if !self.boundaries.load(Ordering::SeqCst) {
            self.kill(Stop::NoBoundaries);
        } else {
            self.ask_child_to_stop();
            let control = Arc::clone(self);
            let run = self.runs.load(Ordering::SeqCst);
            let spawned = std::thread::Builder::new()
                .name("interrupt-grace".into())
                .spawn(move || {
                    std::thread::sleep(grace);
                    let running = control.running.lock().unwrap_or_else(|e| e.into_inner());
                    if *running && control.runs.load(Ordering::SeqCst) == run {
                        control.kill(Stop::NoBoundary(grace));
                    }
                });
            if spawned.is_err() {
                self.kill(Stop::NoBoundary(Duration::ZERO));
            }
        }
        true
    }

    fn ask_child_to_stop(&self) {
        self.signal_child(libc::SIGUSR1);
    }

    /// Withdraws an interrupt request that no loop of the run took (after a run that was
    /// interrupted: the request may have come after the cell's code ended, or the cell never ran).
    pub fn forget_request(&self) {
        self.signal_child(libc::SIGUSR2);
    }

    /// Sends `signal` to the child, holding its handle and only while it runs (a reaped child's
    /// pid may belong to another process by now).
    fn signal_child(&self, signal: libc::c_int) {
        self.with_child(|child| {
            if !matches!(child.try_wait(), Ok(None)) {
                return;
            }
            // SAFETY: kill(2) on our running child; it handles SIGUSR1/SIGUSR2 (child::interrupt).
            if unsafe { libc::kill(child.id() as libc::pid_t, signal) } != 0 {
                tracing::warn!(
                    "could not signal the child process: {}",
                    std::io::Error::last_os_error()
                );
            }
        });
    }

    /// Stops the child process (called with `running` held, or from the grace thread holding it).
    fn kill(&self, why: Stop) {
        *self.stop.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
        self.with_child(|child| {
            if let Err(error) = child.kill() {
                tracing::warn!("could not stop the child process: {error}");
            }
        });
    }
}

/// The grace period: [`GRACE_ENV`] seconds, else [`DEFAULT_GRACE`].
pub fn grace() -> Duration {
    std::env::var(GRACE_ENV)
        .ok()
        .and_then(|text| text.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s >= 0.0)
        .map_or(DEFAULT_GRACE, Duration::from_secs_f64)
}
