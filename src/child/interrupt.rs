//! Interrupts that keep the cell's variables: SIGINT (a terminal's Ctrl-C, or a frontend that
//! signals the process group) and SIGUSR1 (the kernel's interrupt) only ask the running cell to
//! stop at its next loop boundary; SIGUSR2 withdraws a request no cell took (see [`tchmem_wire::progress::RunState`]). The kernel stops
//! the process itself when no boundary comes.

use std::sync::atomic::Ordering;

use super::runtime_slot;

extern "C" fn ask_to_stop(signal: libc::c_int) {
    // Async-signal-safe: one compare-and-swap on an atomic in a static.
    if signal == libc::SIGUSR2 {
        runtime_slot::run_state().forget_request();
    } else {
        runtime_slot::run_state().request_interrupt();
    }
}

/// The id loops compare with the cell thread's (`pthread_self`, cheap on every iteration).
pub fn this_thread() -> u64 {
    // SAFETY: always valid to call.
    unsafe { libc::pthread_self() as u64 }
}

/// Makes the calling thread the one cells run on, and routes SIGINT and SIGUSR1 to the running
/// cell (SIGUSR2: the kernel forgets a request that came too late).
pub fn install() {
    runtime_slot::run_state()
        .cell_thread
        .store(this_thread(), Ordering::SeqCst);
    // The handler only touches an atomic.
    on_interrupt_signals(ask_to_stop);
}

/// The kernel's interrupt signals (SIGINT, SIGUSR1, SIGUSR2) go to `handler`, which must be
/// async-signal-safe; a signal that cannot be handled is said on stderr.
pub fn on_interrupt_signals(handler: extern "C" fn(libc::c_int)) {
    // SAFETY: sigaction with a zeroed action whose handler the caller vouches for.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = handler as *const () as usize;
        action.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut action.sa_mask);
        for signal in [libc::SIGINT, libc::SIGUSR1, libc::SIGUSR2] {
            if libc::sigaction(signal, &action, std::ptr::null_mut()) != 0 {
                eprintln!(
                    "tchmem child: cannot handle signal {signal}: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
    }
}
