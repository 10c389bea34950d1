//! Parsing user code on a thread of its own. syn recurses once per nesting level (and per unary
//! operator), so deep input needs a large stack; a bug that panics must not take the kernel down;
//! and proc-macro2 keeps every parsed source text per thread (for span locations), which is freed
//! only when the thread ends.

/// Why a job on the parsing thread gave no answer.
#[derive(Debug, thiserror::Error)]
pub enum ParseThreadError {
    /// The thread could not be started.
    #[error("could not start a parsing thread: {0}")]
    Spawn(#[from] std::io::Error),
    /// The job panicked (a bug in the parsing code).
    #[error("the parser panicked")]
    Panicked,
}

/// Runs `job` on a new thread named `name` with a stack of `stack_bytes`, and waits for it.
pub fn run<T: Send + 'static>(
    name: &str,
    stack_bytes: usize,
    job: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ParseThreadError> {
    let handle = std::thread::Builder::new()
        .name(name.into())
        .stack_size(stack_bytes)
        .spawn(job)?;
    handle.join().map_err(|_| ParseThreadError::Panicked)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_come_back_and_panics_stay_on_the_thread() {
        assert_eq!(run("t", 1 << 20, || 6 * 7).unwrap(), 42);
        let panicked = run("t", 1 << 20, || -> u8 { panic!("bug") });
        assert!(matches!(panicked, Err(ParseThreadError::Panicked)));
    }
}
