//! A failed cell as Jupyter shows it, and the names of the ways a cell can fail.
//!
//! The names are a type, not strings: code that reacts to a kind of failure (a trial that ran
//! out of memory, a run stopped by an interrupt) matches a variant, and the text Jupyter shows
//! as `ename` comes from one place ([`ErrorName::as_str`]).

use std::fmt;

/// What kind of failure a cell had: Jupyter's `ename`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorName {
    /// The cell's Rust did not compile.
    CompilationError,
    /// The cell's code panicked; variables from earlier cells survive.
    Panic,
    /// The cell ran out of memory (CUDA or CPU), told by the allocator or libtorch's message.
    OutOfMemory,
    /// The user interrupted the cell and the process running cells was stopped.
    Interrupted,
    /// The process running cells died without being asked to (abort, segfault, kill).
    ChildProcessCrashed,
    /// A type was redefined, so variables of the old type were dropped.
    VariablesLost,
    /// Any other message evcxr raised.
    Error,
    /// A magic's line or flags were wrong (the message says what to write).
    MagicError,
    /// An evcxr command (`:opt`, …) tchmem answers itself failed.
    CommandError,
    /// The evaluation context could not be created: every cell reports why.
    KernelNotReady,
    /// The kernel's own machinery failed (the engine thread stopped).
    KernelError,
    /// A rewrite does not apply to the cell's loop (the reason names the line).
    RewriteRefused,
    /// `%memestimate`/`%memfit` acts on a training cell and none ran yet.
    NoTrainingCell,
    /// The estimator had nothing to calibrate on.
    EstimateFailed,
    /// `%%optimize --fit` found no combination under the budget.
    DoesNotFit,
    /// A side of `%%optimize --compare` failed other than by running out of memory.
    CompareFailed,
    /// A `--compare` side ran but recorded no optimizer step.
    NoStep,
    /// `%memfree` got an answer it could not read from the runtime.
    MemFreeFailed,
    /// The ranks of a `%%distributed` world could not be started.
    WorldFailed,
}

impl ErrorName {
    /// The name as Jupyter shows it (the variant's name).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorName::CompilationError => "CompilationError",
            ErrorName::Panic => "Panic",
            ErrorName::OutOfMemory => "OutOfMemory",
            ErrorName::Interrupted => "Interrupted",
            ErrorName::ChildProcessCrashed => "ChildProcessCrashed",
            ErrorName::VariablesLost => "VariablesLost",
            ErrorName::Error => "Error",
            ErrorName::MagicError => "MagicError",
            ErrorName::CommandError => "CommandError",
            ErrorName::KernelNotReady => "KernelNotReady",
            ErrorName::KernelError => "KernelError",
            ErrorName::RewriteRefused => "RewriteRefused",
            ErrorName::NoTrainingCell => "NoTrainingCell",
            ErrorName::EstimateFailed => "EstimateFailed",
            ErrorName::DoesNotFit => "DoesNotFit",
            ErrorName::CompareFailed => "CompareFailed",
            ErrorName::NoStep => "NoStep",
            ErrorName::MemFreeFailed => "MemFreeFailed",
            ErrorName::WorldFailed => "WorldFailed",
        }
    }

    /// Whether this failure ends a magic's series of runs: the user interrupted, or the process
    /// that runs cells is gone.
    pub fn stops_the_run(self) -> bool {
        matches!(
            self,
            ErrorName::Interrupted | ErrorName::ChildProcessCrashed
        )
    }
}

impl fmt::Display for ErrorName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A failed cell, as Jupyter shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CellError {
    /// What kind of failure.
    pub ename: ErrorName,
    /// One-line explanation.
    pub evalue: String,
    /// The full report, one entry per line (may hold ANSI colours).
    pub traceback: Vec<String>,
}

impl CellError {
    /// Whether this error ends a magic's series of runs (see [`ErrorName::stops_the_run`]).
    pub fn stops_the_run(&self) -> bool {
        self.ename.stops_the_run()
    }

    /// An error with the given name and message and a traceback that repeats them.
    pub fn new(ename: ErrorName, evalue: impl Into<String>) -> Self {
        let evalue = evalue.into();
        let first = evalue.lines().next().unwrap_or_default();
        let traceback = std::iter::once(format!("{ename}: {first}"))
            .chain(evalue.lines().skip(1).map(str::to_string))
            .collect();
        Self {
            ename,
            evalue,
            traceback,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_traceback_starts_with_the_name_and_the_first_line() {
        let error = CellError::new(ErrorName::MagicError, "bad flag\nuse --help");
        assert_eq!(error.traceback, ["MagicError: bad flag", "use --help"]);
    }

    #[test]
    fn only_interrupts_and_crashes_stop_a_series_of_runs() {
        assert!(ErrorName::Interrupted.stops_the_run());
        assert!(ErrorName::ChildProcessCrashed.stops_the_run());
        assert!(!ErrorName::OutOfMemory.stops_the_run());
        assert!(!ErrorName::Panic.stops_the_run());
    }
}
