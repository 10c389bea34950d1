//! Turning evcxr's failures into Jupyter errors (ename, evalue, traceback) that explain
//! themselves.

mod compile;

use evcxr::{CompilationError, Error as EvcxrError};

pub use crate::cell_error::{CellError, ErrorName};

use super::control::Stop;
use super::streams::{Leftovers, PanicReport};
use tchmem_wire::progress::{grouped, LoopCount};

/// Why the child went away, as the engine knows it.
pub enum Termination {
    /// The user asked to interrupt the cell (and why the process was stopped, when known).
    Interrupted(Option<Stop>),
    /// Nobody asked: the child crashed or was killed from outside.
    Crashed,
}

/// Why an interrupt had to stop the process running cells, in the user's terms.
fn why_stopped(stop: Option<Stop>) -> String {
    match stop {
        Some(Stop::NoBoundary(grace)) => format!(
            "The cell reached no loop boundary within {:.0} s of the interrupt (a single long \
             call, or a loop in code the kernel does not see: an iterator chain, a function \
             from outside the notebook, which can call tchmem::interrupted()), so the process \
             running cells was stopped: all variables were lost. The next cell runs in a fresh \
             process.",
            grace.as_secs_f64()
        ),
        Some(Stop::SecondInterrupt) => "A second interrupt stopped the process running cells at \
             once: all variables were lost. The next cell runs in a fresh process."
            .into(),
        Some(Stop::NoBoundaries) | None => "The cell was interrupted. Without the tchmem runtime \
             the cell has no loop boundaries to stop at, so the process running cells was \
             stopped: all variables were lost. The next cell runs in a fresh process."
            .into(),
    }
}

/// A cell an interrupt stopped at a loop boundary: the variables of earlier cells are kept.
pub fn stopped_at(stopped: &LoopCount) -> CellError {
    CellError::new(
        ErrorName::Interrupted,
        format!(
            "stopped at the start of iteration {} of {}; variables kept (those this cell \
             defined are not)",
            grouped(stopped.iterations),
            stopped.name()
        ),
    )
}

/// Renders an evcxr error raised while running `code`. The kernel may have changed the code on
/// its way to the compiler without moving lines (loop checks): `to_code` turns the compiler's
/// (line, column) into `code`'s.
pub fn from_evcxr(
    error: EvcxrError,
    code: &str,
    termination: Termination,
    to_code: &dyn Fn((usize, usize)) -> (usize, usize),
) -> CellError {
    match error {
        EvcxrError::CompilationErrors(errors) => compilation(&errors, code, to_code),
        EvcxrError::SubprocessTerminated(details) => match termination {
            Termination::Interrupted(stop) => {
                CellError::new(ErrorName::Interrupted, why_stopped(stop))
            }
            Termination::Crashed => CellError::new(
                ErrorName::ChildProcessCrashed,
                format!(
                    "The process running cells died, so all variables were lost; the next cell \
                     runs in a fresh process.\n{}",
                    details.trim()
                ),
            ),
        },
        EvcxrError::TypeRedefinedVariablesLost(variables) => CellError::new(
            ErrorName::VariablesLost,
            format!(
                "A type was redefined, so these variables of the old type were lost: {}",
                variables.join(", ")
            ),
        ),
        EvcxrError::Message(message) => CellError::new(ErrorName::Error, message),
    }
}

/// A panic caught in the cell: the last one the runtime's hook reported, else the one the
/// default hook wrote to stderr (when the runtime is not loaded).
pub fn panic(leftovers: &Leftovers) -> CellError {
    let message = match leftovers.panics.last() {
        // A location in the cell's generated crate (src/lib.rs) means nothing to the user.
        Some(panic) => match panic.location.as_deref() {
            Some(location) if !location.starts_with("src/lib.rs:") => {
                format!("{} (at {location})", panic.message)
            }
            _ => panic.message.clone(),
        },
        None => panic_message(&leftovers.stderr).unwrap_or_else(|| "the cell panicked".into()),
    };
    let mut error = CellError::new(ErrorName::Panic, tidy_torch_error(&message));
    error.traceback.push(
        "Variables defined in this cell were dropped; variables from earlier cells are intact."
            .into(),
    );
    error
}

/// libtorch's errors reach a panic as `Torch("<what>\nException raised from <where> (most
/// recent call first):\nframe #0: …")`, Debug-escaped: dozens of C++ frames that say nothing to
/// a notebook user. Keeps what went wrong and the C++ function and file that raised it.
fn tidy_torch_error(message: &str) -> String {
    const OPEN: &str = "Torch(\"";
    let Some(start) = message.find(OPEN) else {
        return message.to_string();
    };
    let rest = &message[start + OPEN.len()..];
    let Some(close) = rest.find("\\nException raised from ") else {
        return message.to_string();
    };
    let what = rest[..close].replace("\\\"", "\"");
    let after = &rest[close + "\\nException raised from ".len()..];
    let raised = after
        .split(" (most recent call first)")
        .next()
        .unwrap_or_default()
        .split("\\n")
        .next()
        .unwrap_or_default();
    let tail = after.find("\")").map_or("", |end| &after[end + 2..]);
    format!(
        "{}libtorch: {what} (raised in {raised}){tail}",
        &message[..start]
    )
}

/// A panic as the default hook would have printed it.
pub fn describe_panic(panic: &PanicReport) -> String {
    let location = panic.location.as_deref().unwrap_or("an unknown location");
    format!(
        "thread '{}' panicked at {location}:\n{}\n",
        panic.thread, panic.message
    )
}

/// Extracts the message of the last panic in a cell's stderr: the lines after
/// `thread '…' panicked at file:line:col:` up to the backtrace note.
fn panic_message(stderr: &str) -> Option<String> {
    let lines: Vec<&str> = stderr.lines().collect();
    let start = lines
        .iter()
        .rposition(|line| line.starts_with("thread '") && line.contains(" panicked at "))?;
    let message: Vec<&str> = lines[start + 1..]
        .iter()
        .take_while(|line| !line.starts_with("note: ") && !line.starts_with("stack backtrace:"))
        .copied()
        .collect();
    let location = lines[start]
        .split_once(" panicked at ")
        .map(|(_, at)| at.trim_end_matches(':'))
        .unwrap_or_default();
    let message = message.join("\n");
    Some(if location.is_empty() {
        message
    } else {
        format!("{message} (at {location})")
    })
}

/// Every compile error against the cell's own lines (see [`compile`]), one report after another.
fn compilation(
    errors: &[CompilationError],
    code: &str,
    to_code: &dyn Fn((usize, usize)) -> (usize, usize),
) -> CellError {
    let mut traceback = Vec::new();
    for error in errors {
        if !traceback.is_empty() {
            traceback.push(String::new());
        }
        let mut diagnostic = compile::diagnostic(error);
        for label in &mut diagnostic.labels {
            label.span.start = to_code(label.span.start);
            label.span.end = to_code(label.span.end);
        }
        let report = compile::render(&diagnostic, code, compile::Style::Ansi);
        traceback.extend(report.lines().map(str::to_string));
    }
    let evalue = errors
        .first()
        .map(|error| error.message())
        .unwrap_or_else(|| "compilation failed".into());
    CellError {
        ename: ErrorName::CompilationError,
        evalue,
        traceback,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panic_message_and_location_come_from_stderr() {
        // Rust 1.95 writes the thread id after the name.
        let stderr = "some output\nthread '<unnamed>' (19559) panicked at src/lib.rs:12:5:\n\
                      boom: 3\nnote: run with `RUST_BACKTRACE=1`\n";
        let error = panic(&Leftovers {
            stderr: stderr.into(),
            ..Default::default()
        });
        assert_eq!(error.ename, ErrorName::Panic);
        assert_eq!(error.evalue, "boom: 3 (at src/lib.rs:12:5)");
        assert!(error
            .traceback
            .last()
            .unwrap()
            .contains("earlier cells are intact"));
    }

    #[test]
    fn hook_reports_take_precedence_over_stderr() {
        let leftovers = Leftovers {
            stderr: "thread 'main' panicked at x.rs:1:1:\nold\n".into(),
            panics: vec![PanicReport {
                thread: "<unnamed>".into(),
                message: "index out of bounds".into(),
                location: Some("src/lib.rs:3:1".into()),
            }],
            ..Default::default()
        };
        assert_eq!(panic(&leftovers).evalue, "index out of bounds");
        let mut in_a_crate = leftovers;
        in_a_crate.panics[0].location = Some("tch-0.24.0/src/tensor.rs:9:9".into());
        assert_eq!(
            panic(&in_a_crate).evalue,
            "index out of bounds (at tch-0.24.0/src/tensor.rs:9:9)"
        );
    }

    #[test]
    fn libtorch_errors_lose_their_cxx_frames() {
        let message = "called `Result::unwrap()` on an `Err` value: Torch(\"mat1 and mat2 shapes \
             cannot be multiplied (4x3 and 1x1)\\nException raised from meta at \
             /pytorch/aten/src/ATen/native/LinearAlgebra.cpp:195 (most recent call first):\\n\
             frame #0: c10::Error::Error(c10::SourceLocation, std::string)\\nframe #1: …\")";
        assert_eq!(
            tidy_torch_error(message),
            "called `Result::unwrap()` on an `Err` value: libtorch: mat1 and mat2 shapes cannot \
             be multiplied (4x3 and 1x1) (raised in meta at \
             /pytorch/aten/src/ATen/native/LinearAlgebra.cpp:195)"
        );
        assert_eq!(
            tidy_torch_error("index out of bounds"),
            "index out of bounds"
        );
    }

    #[test]
    fn panic_without_message_still_explains() {
        assert_eq!(panic(&Leftovers::default()).evalue, "the cell panicked");
    }

    #[test]
    fn crash_and_interrupt_say_variables_were_lost() {
        let crash = from_evcxr(
            EvcxrError::SubprocessTerminated("signal: 11".into()),
            "",
            Termination::Crashed,
            &|at| at,
        );
        assert_eq!(crash.ename, ErrorName::ChildProcessCrashed);
        assert!(
            crash.evalue.contains("variables were lost") && crash.evalue.contains("signal: 11")
        );
        let interrupt = from_evcxr(
            EvcxrError::SubprocessTerminated(String::new()),
            "",
            Termination::Interrupted(Some(Stop::NoBoundary(std::time::Duration::from_secs(5)))),
            &|at| at,
        );
        assert_eq!(interrupt.ename, ErrorName::Interrupted);
        assert!(interrupt.evalue.contains("no loop boundary within 5 s"));
        let stopped = stopped_at(&LoopCount {
            line: 14,
            function: None,
            iterations: 1204,
        });
        assert_eq!(stopped.ename, ErrorName::Interrupted);
        assert!(stopped.evalue.starts_with(
            "stopped at the start of iteration 1,204 of the loop at line 14; variables kept"
        ));
    }
}
