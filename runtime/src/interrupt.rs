//! Stopping a running cell where it stands, keeping the notebook's variables.
//!
//! The kernel puts a check at the start of every `for`, `while` and `loop` body of a cell's code
//! ([`__at_loop!`](crate::__at_loop), on the loop's own line). When the user interrupts, the next
//! check on the cell's thread unwinds the cell (a panic without a message, which evcxr catches):
//! the variables of earlier cells (the model, its VarStore, the optimizer) stay as they were,
//! and the kernel says where the cell stopped. A loop the kernel does not see (an iterator
//! chain, a function outside the notebook) can ask [`interrupted`] itself.

use std::sync::OnceLock;

pub use tchmem_wire::progress::LoopSite;
use tchmem_wire::progress::RunState;

use crate::state;

/// The running cell's shared state: the child's, inside the kernel; a local one elsewhere (where
/// nothing asks to interrupt).
pub(crate) fn run_state() -> &'static RunState {
    static RUN: OnceLock<&'static RunState> = OnceLock::new();
    RUN.get_or_init(|| match state::child_slot() {
        Some(slot) => &slot.run,
        None => Box::leak(Box::new(RunState::new())),
    })
}

/// Whether the user asked to interrupt the running cell. A loop that checks it and ends (with
/// `break` or `return`) ends the cell as it chooses, and the kernel does not stop the process.
///
/// ```no_run
/// for (i, batch) in (0..1000).map(|i| i * 2).enumerate() {
///     if tchmem::interrupt::interrupted() {
///         break;
///     }
/// #   let _ = (i, batch);
/// }
/// ```
pub fn interrupted() -> bool {
    run_state().take_interrupt()
}

/// Asks the running cell to stop at its next loop boundary once `seconds` have passed, as the
/// stop button would then: a time box for a training loop (Lightning's `max_time`). The cell
/// ends with the same `Interrupted` error and keeps every variable of earlier cells; a cell that
/// ends sooner is not affected, nor is the next one.
///
/// ```no_run
/// tchmem::interrupt::after(600.0); // train for ten minutes, then carry on in the next cell
/// ```
pub fn after(seconds: f64) {
    let run = run_state();
    let this_run = run.generation.load(std::sync::atomic::Ordering::SeqCst);
    let wait = std::time::Duration::from_secs_f64(seconds.max(0.0));
    let spawned = std::thread::Builder::new()
        .name("tchmem-interrupt-after".into())
        .spawn(move || {
            std::thread::sleep(wait);
            if run.generation.load(std::sync::atomic::Ordering::SeqCst) == this_run {
                run.request_interrupt();
            }
        });
    if let Err(error) = spawned {
        eprintln!("tchmem::interrupt::after: no timer thread ({error}); the cell runs on");
    }
}

/// The payload a stopped cell unwinds with (no message: the kernel writes its own).
#[derive(Debug, Clone, Copy)]
pub struct Stopped;

/// The start of an iteration of `site`'s loop: counts it, and stops the cell when the user
/// asked to interrupt. Called by [`__at_loop!`](crate::__at_loop); not meant for cells.
#[doc(hidden)]
#[inline]
pub fn __enter(site: &'static LoopSite) {
    // A loop in a Drop run while a panic unwinds must not take the request (nor stop: a second
    // unwind would abort).
    if std::thread::panicking() {
        return;
    }
    // SAFETY: always valid to call.
    let this_thread = unsafe { libc::pthread_self() } as u64;
    if run_state().enter_loop(site, this_thread) {
        stop();
    }
}

#[cold]
fn stop() -> ! {
    // resume_unwind skips the panic hook: no "panicked at" text for a stop the user asked for.
    std::panic::resume_unwind(Box::new(Stopped))
}

/// The check the kernel inserts at the start of a loop body: a static [`LoopSite`] for the loop
/// at `line` (inside the function named, or `""`) and [`__enter`] on it.
#[doc(hidden)]
#[macro_export]
macro_rules! __at_loop {
    ($line:expr, $function:expr) => {{
        static SITE: $crate::interrupt::LoopSite =
            $crate::interrupt::LoopSite::new($line, $function);
        $crate::interrupt::__enter(&SITE);
    }};
}
