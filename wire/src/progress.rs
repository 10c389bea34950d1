//! What a running cell shares with the child while it runs: the interrupt request, the loops it
//! is in and how far they got, the progress and loss it reports, and the samples the child
//! sends the kernel for the live view.
//!
//! [`RunState`] lives in the child's [`crate::ChildSlot`]; the child writes the interrupt request
//! (from a signal handler) and reads the rest from a sampling thread, while the cell's code (the
//! runtime, and the loop checks the kernel inserts) writes it. Atomics only: a signal handler and
//! two threads touch it, and no lock may be taken inside a training loop.

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

/// How many distinct loops of one cell are followed (the first ones entered).
pub const MAX_LOOPS: usize = 8;

/// No interrupt asked for.
pub const IDLE: u32 = 0;
/// The user asked to interrupt; the next loop boundary of the cell's thread stops the cell.
pub const REQUESTED: u32 = 1;
/// A loop boundary took the request: the cell is unwinding to its end.
pub const STOPPING: u32 = 2;
/// `tchmem::interrupted()` told the cell's own code, which stops as it sees fit.
pub const SEEN: u32 = 3;

/// One loop in a cell's code (a `static` next to it, made by the kernel's inserted check).
#[repr(C)]
pub struct LoopSite {
    /// The loop's line in the cell.
    pub line: u32,
    function: *const u8,
    function_len: usize,
    /// Iterations started in the current cell run.
    pub iterations: AtomicU64,
    /// The cell run ([`RunState::generation`]) the count belongs to.
    pub generation: AtomicU64,
}

// SAFETY: `function` points into a `&'static str`; the rest are atomics.
unsafe impl Sync for LoopSite {}

impl LoopSite {
    /// A loop at `line`, inside the function `function` ("" at the cell's top level).
    pub const fn new(line: u32, function: &'static str) -> Self {
        LoopSite {
            line,
            function: function.as_ptr(),
            function_len: function.len(),
            iterations: AtomicU64::new(0),
            generation: AtomicU64::new(0),
        }
    }

    /// The function the loop is in, if it is not at the cell's top level.
    pub fn function(&self) -> Option<&str> {
        // SAFETY: built from a `&'static str` in `new`; cell libraries are never unloaded.
        let name = unsafe {
            std::str::from_utf8_unchecked(std::slice::from_raw_parts(
                self.function,
                self.function_len,
            ))
        };
        (!name.is_empty()).then_some(name)
    }

    /// Where the loop is and how far it got.
    pub fn count(&self) -> LoopCount {
        LoopCount {
            line: self.line,
            function: self.function().map(str::to_string),
            iterations: self.iterations.load(Ordering::Relaxed),
        }
    }
}

/// The running cell's state, shared by the child and the cell's code.
#[repr(C)]
pub struct RunState {
    /// [`IDLE`], [`REQUESTED`], [`STOPPING`] or [`SEEN`].
    pub interrupt: AtomicU32,
    /// `pthread_self()` of the thread that runs cells: only that thread is stopped at a loop.
    pub cell_thread: AtomicU64,
    /// Counts cell runs; loop counts of an older run start again.
    pub generation: AtomicU64,
    /// The loops entered during this run, in the order first entered (only sites, which live
    /// as long as the process: private, so that nothing else can be stored).
    loops: [AtomicPtr<LoopSite>; MAX_LOOPS],
    /// The loop the cell stopped at, after an interrupt.
    stopped_at: AtomicPtr<LoopSite>,
    /// `tchmem::progress(step, total)`: the step (valid once `step_set`).
    pub step: AtomicU64,
    /// The total of steps (0: not given).
    pub total: AtomicU64,
    /// A step was reported in this run.
    pub step_set: AtomicBool,
    /// The last loss, as `f64` bits (valid once `loss_set`).
    pub loss_bits: AtomicU64,
    /// A loss was reported in this run.
    pub loss_set: AtomicBool,
    /// Optimizer steps the runtime's phase markers counted in this run.
    pub optimizer_steps: AtomicU64,
    /// `extern "C" fn(*mut MemoryNow) -> bool`: the device's memory now (the runtime's).
    pub sample_memory: AtomicPtr<std::ffi::c_void>,
}

impl RunState {
    /// A state with nothing running.
    pub const fn new() -> Self {
        #[allow(clippy::declare_interior_mutable_const)]
        const NO_LOOP: AtomicPtr<LoopSite> = AtomicPtr::new(std::ptr::null_mut());
        RunState {
            interrupt: AtomicU32::new(IDLE),
            cell_thread: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            loops: [NO_LOOP; MAX_LOOPS],
            stopped_at: AtomicPtr::new(std::ptr::null_mut()),
            step: AtomicU64::new(0),
            total: AtomicU64::new(0),
            step_set: AtomicBool::new(false),
            loss_bits: AtomicU64::new(0),
            loss_set: AtomicBool::new(false),
            optimizer_steps: AtomicU64::new(0),
            sample_memory: AtomicPtr::new(std::ptr::null_mut()),
        }
    }

    /// Starts a cell run: what the last one left is forgotten (an interrupt asked for while the
    /// cell compiled stays asked for).
    pub fn begin_run(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        for slot in &self.loops {
            slot.store(std::ptr::null_mut(), Ordering::SeqCst);
        }
        self.stopped_at
            .store(std::ptr::null_mut(), Ordering::SeqCst);
        self.step_set.store(false, Ordering::SeqCst);
        self.total.store(0, Ordering::SeqCst);
        self.loss_set.store(false, Ordering::SeqCst);
        self.optimizer_steps.store(0, Ordering::SeqCst);
    }

    /// Ends a cell run: where it stopped, if an interrupt stopped it, and whether its own code
    /// saw the interrupt; no interrupt is pending afterwards.
    pub fn end_run(&self) -> (Option<LoopCount>, bool) {
        let state = self.interrupt.swap(IDLE, Ordering::SeqCst);
        let stopped = self.stopped_at.swap(std::ptr::null_mut(), Ordering::SeqCst);
        // SAFETY: sites are statics of cell libraries, which are never unloaded.
        let stopped = if state == STOPPING {
            unsafe { stopped.as_ref() }.map(LoopSite::count)
        } else {
            None
        };
        (stopped, state == SEEN)
    }

    /// Forgets an interrupt that is still only asked for (async-signal-safe: one atomic). The
    /// kernel sends it after a run it interrupted, so that a request that came too late for that
    /// run (or for a cell that never ran) does not stop the next one.
    pub fn forget_request(&self) {
        let _ =
            self.interrupt
                .compare_exchange(REQUESTED, IDLE, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// Asks the cell to stop at its next loop boundary (async-signal-safe: one atomic).
    pub fn request_interrupt(&self) {
        let _ =
            self.interrupt
                .compare_exchange(IDLE, REQUESTED, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// Notes that `site` started an iteration; true when the cell should stop there. Called on
    /// the cell's thread at the start of every loop body, so it must stay cheap: relaxed loads and
    /// plain stores, one compare-and-swap only when an interrupt is pending.
    pub fn enter_loop(&self, site: &'static LoopSite, this_thread: u64) -> bool {
        let generation = self.generation.load(Ordering::Relaxed);
        if site.generation.load(Ordering::Relaxed) != generation {
            site.generation.store(generation, Ordering::Relaxed);
            site.iterations.store(0, Ordering::Relaxed);
            self.follow(site);
        }
        let iterations = site.iterations.load(Ordering::Relaxed) + 1;
        site.iterations.store(iterations, Ordering::Relaxed);
        if self.interrupt.load(Ordering::Relaxed) != REQUESTED
            || self.cell_thread.load(Ordering::Relaxed) != this_thread
        {
            return false;
        }
        let took = self
            .interrupt
            .compare_exchange(REQUESTED, STOPPING, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok();
        if took {
            self.stopped_at
                .store(site as *const LoopSite as *mut LoopSite, Ordering::SeqCst);
        }
        took
    }

    /// Whether an interrupt was asked for; the cell's code that asks takes it over.
    pub fn take_interrupt(&self) -> bool {
        let state = self.interrupt.load(Ordering::SeqCst);
        if state == REQUESTED {
            let _ = self.interrupt.compare_exchange(
                REQUESTED,
                SEEN,
                Ordering::SeqCst,
                Ordering::SeqCst,
            );
        }
        matches!(state, REQUESTED | SEEN | STOPPING)
    }

    fn follow(&self, site: &'static LoopSite) {
        let pointer = site as *const LoopSite as *mut LoopSite;
        for slot in &self.loops {
            match slot.compare_exchange(
                std::ptr::null_mut(),
                pointer,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => return,
                Err(existing) if existing == pointer => return,
                Err(_) => {}
            }
        }
    }

    /// The loops of this run and how far each got.
    pub fn loop_counts(&self) -> Vec<LoopCount> {
        self.loops
            .iter()
            .map(|slot| slot.load(Ordering::SeqCst))
            // SAFETY: as in `end_run`.
            .filter_map(|site| unsafe { site.as_ref() })
            .map(LoopSite::count)
            .collect()
    }

    /// Reports a step (and the total, when known).
    pub fn set_progress(&self, step: u64, total: Option<u64>) {
        self.step.store(step, Ordering::Relaxed);
        self.total.store(total.unwrap_or(0), Ordering::Relaxed);
        self.step_set.store(true, Ordering::Release);
    }

    /// Reports the last loss.
    pub fn set_loss(&self, loss: f64) {
        self.loss_bits.store(loss.to_bits(), Ordering::Relaxed);
        self.loss_set.store(true, Ordering::Release);
    }

    /// What the run reported so far (without memory, which the runtime measures).
    pub fn progress(&self) -> Progress {
        let step = self
            .step_set
            .load(Ordering::Acquire)
            .then(|| self.step.load(Ordering::Relaxed));
        let total = Some(self.total.load(Ordering::Relaxed)).filter(|&t| t > 0 && step.is_some());
        let loss = self
            .loss_set
            .load(Ordering::Acquire)
            .then(|| f64::from_bits(self.loss_bits.load(Ordering::Relaxed)));
        Progress {
            step,
            total,
            loss,
            optimizer_steps: self.optimizer_steps.load(Ordering::Relaxed),
            loops: self.loop_counts(),
        }
    }
}

impl Default for RunState {
    fn default() -> Self {
        Self::new()
    }
}

/// A loop's place and its iterations so far.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LoopCount {
    /// Line of the loop in its cell.
    pub line: u32,
    /// The function the loop is in (`None` at the cell's top level).
    #[serde(default)]
    pub function: Option<String>,
    /// Iterations started.
    pub iterations: u64,
}

impl LoopCount {
    /// "the loop at line 14", or "the loop at line 14 (in `train`)".
    pub fn name(&self) -> String {
        match &self.function {
            Some(function) => format!("the loop at line {} (in `{function}`)", self.line),
            None => format!("the loop at line {}", self.line),
        }
    }
}

/// `1204` as `1,204`.
pub fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// What a running cell reported about its progress.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Progress {
    /// The step given to `tchmem::progress`.
    #[serde(default)]
    pub step: Option<u64>,
    /// The total given with it.
    #[serde(default)]
    pub total: Option<u64>,
    /// The last loss given to `tchmem::progress::loss`.
    #[serde(default)]
    pub loss: Option<f64>,
    /// Optimizer steps marked by the runtime (rewritten loops, tchmem's optimizers).
    #[serde(default)]
    pub optimizer_steps: u64,
    /// The cell's loops and their iterations.
    #[serde(default)]
    pub loops: Vec<LoopCount>,
}

/// The device's memory at one moment (`repr(C)`: the runtime fills it for the child).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct MemoryNow {
    /// Bytes allocated to tensors.
    pub allocated: u64,
    /// Bytes the caching allocator holds.
    pub reserved: u64,
    /// Peak allocated since the cell started.
    pub peak_allocated: u64,
    /// Peak reserved since the cell started.
    pub peak_reserved: u64,
    /// The device's memory.
    pub capacity: u64,
}

/// One sample of a running cell, sent by the child a few times a second once the cell has run
/// for a second.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct LiveSample {
    /// Seconds since the cell's code started.
    pub elapsed: f64,
    /// The device's memory (`None` without CUDA).
    #[serde(default)]
    pub memory: Option<MemoryNow>,
    /// What the run reported.
    #[serde(default)]
    pub progress: Progress,
}

#[cfg(test)]
mod tests {
    use super::*;

    static OUTER: LoopSite = LoopSite::new(3, "");
    static INNER: LoopSite = LoopSite::new(5, "train");
    static ASKING: LoopSite = LoopSite::new(1, "");

    #[test]
    fn loops_count_per_run_and_stop_only_the_cell_thread_once_asked() {
        let run = RunState::new();
        run.cell_thread.store(7, Ordering::SeqCst);
        run.begin_run();
        for _ in 0..2 {
            assert!(!run.enter_loop(&OUTER, 7));
            for _ in 0..3 {
                assert!(!run.enter_loop(&INNER, 7));
            }
        }
        let counts = run.loop_counts();
        assert_eq!(counts[0].iterations, 2);
        assert_eq!(counts[1].iterations, 6);
        assert_eq!(counts[1].function.as_deref(), Some("train"));
        run.request_interrupt();
        assert!(!run.enter_loop(&INNER, 8), "another thread goes on");
        assert!(run.enter_loop(&INNER, 7));
        assert!(!run.enter_loop(&INNER, 7), "taken once");
        let (stopped, seen) = run.end_run();
        assert_eq!(stopped.map(|s| (s.line, s.iterations)), Some((5, 9)));
        assert!(!seen);
        run.begin_run();
        assert!(!run.enter_loop(&OUTER, 7));
        assert_eq!(
            run.loop_counts()[0].iterations,
            1,
            "a new run counts afresh"
        );
        assert_eq!(run.end_run(), (None, false));
    }

    #[test]
    fn code_that_asks_takes_the_interrupt_over() {
        let run = RunState::new();
        assert!(!run.take_interrupt());
        run.request_interrupt();
        assert!(run.take_interrupt());
        assert!(
            !run.enter_loop(&ASKING, 0),
            "seen by the code, not stopped at a loop"
        );
        assert_eq!(run.end_run(), (None, true));
        run.request_interrupt();
        run.forget_request();
        assert!(
            !run.enter_loop(&ASKING, 0),
            "a forgotten request stops nothing"
        );
    }

    #[test]
    fn progress_reads_back_what_was_set() {
        let run = RunState::new();
        run.begin_run();
        assert_eq!(run.progress(), Progress::default());
        run.set_progress(4, Some(10));
        run.set_loss(2.5);
        let progress = run.progress();
        assert_eq!((progress.step, progress.total), (Some(4), Some(10)));
        assert_eq!(progress.loss, Some(2.5));
    }

    #[test]
    fn loops_and_numbers_read_well() {
        assert_eq!(grouped(1204), "1,204");
        assert_eq!(grouped(12), "12");
        assert_eq!(grouped(1_000_000), "1,000,000");
        let count = LoopCount {
            line: 5,
            function: Some("train".into()),
            iterations: 1,
        };
        assert_eq!(count.name(), "the loop at line 5 (in `train`)");
    }
}
