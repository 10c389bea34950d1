//! Turning evcxr's failures into Jupyter errors (ename, evalue, traceback) that explain
//! themselves.

mod compile;

use evcxr::{CompilationError, Error as EvcxrError};

use super::streams::{Leftovers, PanicReport};
use crate::fit::diagnosis::{diagnose, FailedCell};
use crate::report::format::human_bytes;
use tchmem_wire::memory::MemoryRecord;

/// A failed cell, as Jupyter shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CellError {
    /// Short name of the kind of failure.
    pub ename: String,
    /// One-line explanation.
    pub evalue: String,
    /// The full report, one entry per line (may hold ANSI colours).
    pub traceback: Vec<String>,
}

impl CellError {
    /// Whether this error ends a magic's series of runs: the user interrupted, or the process
    /// that runs cells is gone.
    pub fn stops_the_run(&self) -> bool {
        matches!(self.ename.as_str(), "Interrupted" | "ChildProcessCrashed")
    }

    /// An error with the given name and message and a traceback that repeats them.
    pub fn new(ename: &str, evalue: impl Into<String>) -> Self {
        let evalue = evalue.into();
        let traceback = std::iter::once(format!("{ename}: {}", first_line(&evalue)))
            .chain(evalue.lines().skip(1).map(str::to_string))
            .collect();
        Self {
            ename: ename.into(),
            evalue,
            traceback,
        }
    }
}

/// Why the child went away, as the engine knows it.
pub enum Termination {
    /// The user asked to interrupt the cell.
    Interrupted,
    /// Nobody asked: the child crashed or was killed from outside.
    Crashed,
}

/// Renders an evcxr error raised while running `code`.
pub fn from_evcxr(error: EvcxrError, code: &str, termination: Termination) -> CellError {
    match error {
        EvcxrError::CompilationErrors(errors) => compilation(&errors, code),
        EvcxrError::SubprocessTerminated(details) => match termination {
            Termination::Interrupted => CellError::new(
                "Interrupted",
                "The cell was interrupted. Rust code cannot be stopped safely in the middle, so \
                 the process running cells was stopped: all variables were lost. The next cell \
                 runs in a fresh process.",
            ),
            Termination::Crashed => CellError::new(
                "ChildProcessCrashed",
                format!(
                    "The process running cells died, so all variables were lost; the next cell \
                     runs in a fresh process.\n{}",
                    details.trim()
                ),
            ),
        },
        EvcxrError::TypeRedefinedVariablesLost(variables) => CellError::new(
            "VariablesLost",
            format!(
                "A type was redefined, so these variables of the old type were lost: {}",
                variables.join(", ")
            ),
        ),
        EvcxrError::Message(message) => CellError::new("Error", message),
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
    let mut error = CellError::new("Panic", tidy_torch_error(&message));
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

/// Which memory a failed cell ran out of, judged by libtorch's error text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Exhausted {
    Cuda,
    Cpu,
}

fn exhausted_by_message(error: &CellError) -> Option<Exhausted> {
    let text = format!("{} {}", error.evalue, error.traceback.join("\n"));
    if text.contains("CUDA out of memory") || text.contains("OutOfMemoryError") {
        Some(Exhausted::Cuda)
    } else if text.contains("DefaultCPUAllocator: can't allocate memory") {
        Some(Exhausted::Cpu)
    } else {
        None
    }
}

/// What libtorch's OOM observer saw when the allocator gave up, if it did.
fn at_failure(cuda: &tchmem_wire::memory::CudaMemory) -> String {
    match cuda.oom_events.last() {
        Some(event) => format!(
            " The request that failed was for {}, with {} free on the device (the allocator's \
             limit: {}).",
            human_bytes(event.requested),
            human_bytes(event.device_free),
            human_bytes(event.device_total)
        ),
        None => String::new(),
    }
}

/// What a diagnosed OOM adds after its fixes.
const OOM_KEPT: &str = "Variables defined in this cell were dropped; earlier ones are intact. \
     `%%memprofile --stacks` on the cell shows the largest tensors alive at the failure and the \
     lines that allocated them.";

/// What to try, for both kinds of OOM.
const OOM_ADVICE: &str = "Variables defined in this cell were dropped; earlier ones are intact. \
     To make it fit: see where memory goes in the summary below (tchmem::watch, tchmem::phase), \
     then try %%optimize on the training cell (--checkpoint, --amp bf16, --accumulate K, \
     --optimizer adafactor; %%optimize --help), a smaller batch, or drop tensors you no longer need.";

/// A failed cell that ran out of memory becomes an `OutOfMemory` error that says where memory
/// stood and what to try; any other error is returned unchanged. The allocator's OOM counter
/// decides for CUDA; libtorch's message is the fallback (the process's first CUDA allocation
/// fails before the allocator counts it, as measured on the H200) and the only signal on CPU.
pub fn out_of_memory(error: CellError, record: &MemoryRecord, cell: &FailedCell) -> CellError {
    let counted = record.cuda.as_ref().map_or(0, |c| c.ooms);
    let said = exhausted_by_message(&error);
    let message = match (record.cuda.as_ref(), said) {
        (Some(cuda), _) if counted > 0 || said == Some(Exhausted::Cuda) => format!(
            "CUDA ran out of memory in this cell ({}). After the cell: allocated {}, reserved \
             {}, device free {} of {}; the cell's peak allocation was {}.{}\n{}",
            if counted > 0 {
                format!(
                    "the allocator counted {counted} OOM{}",
                    if counted == 1 { "" } else { "s" }
                )
            } else {
                "libtorch refused the allocation".to_string()
            },
            human_bytes(cuda.after.allocated),
            human_bytes(cuda.after.reserved),
            human_bytes(cuda.device_free),
            human_bytes(cuda.device_total),
            human_bytes(cuda.peak.allocated),
            at_failure(cuda),
            match cuda.oom_events.last() {
                // The observer saw the failure: what was alive, and ranked fixes.
                Some(event) if event.allocated.is_some() => format!(
                    "{}\n{}",
                    diagnose(event, cell).text(cell),
                    if cell.trains { OOM_KEPT } else { OOM_ADVICE }
                ),
                _ => OOM_ADVICE.to_string(),
            },
        ),
        (_, Some(Exhausted::Cpu)) => format!(
            "The CPU allocator could not get the memory this cell asked for (libtorch's \
             DefaultCPUAllocator failed; the request is in the message below).\n{OOM_ADVICE}"
        ),
        (None, Some(Exhausted::Cuda)) => {
            format!("CUDA ran out of memory in this cell.\n{OOM_ADVICE}")
        }
        _ => return error,
    };
    let mut oom = CellError::new("OutOfMemory", message);
    oom.traceback
        .push(format!("{}: {}", error.ename, error.evalue));
    oom
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
fn compilation(errors: &[CompilationError], code: &str) -> CellError {
    let mut traceback = Vec::new();
    for error in errors {
        if !traceback.is_empty() {
            traceback.push(String::new());
        }
        let report = compile::render(&compile::diagnostic(error), code, compile::Style::Ansi);
        traceback.extend(report.lines().map(str::to_string));
    }
    let evalue = errors
        .first()
        .map(|error| error.message())
        .unwrap_or_else(|| "compilation failed".into());
    CellError {
        ename: "CompilationError".into(),
        evalue,
        traceback,
    }
}

fn first_line(text: &str) -> &str {
    text.lines().next().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tchmem_wire::memory::CudaMemory;

    #[test]
    fn panic_message_and_location_come_from_stderr() {
        // Rust 1.95 writes the thread id after the name.
        let stderr = "some output\nthread '<unnamed>' (19559) panicked at src/lib.rs:12:5:\n\
                      boom: 3\nnote: run with `RUST_BACKTRACE=1`\n";
        let error = panic(&Leftovers {
            stderr: stderr.into(),
            ..Default::default()
        });
        assert_eq!(error.ename, "Panic");
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
    fn an_oom_counted_by_the_allocator_becomes_an_out_of_memory_error() {
        let panic = CellError::new("Panic", "Internal torch error: CUDA out of memory");
        let mut record = MemoryRecord {
            device: "cuda:0".into(),
            cuda: Some(CudaMemory {
                ooms: 1,
                device_total: 80 << 30,
                oom_events: vec![tchmem_wire::memory::OomEvent {
                    device: 0,
                    requested: 2 << 30,
                    device_total: 80 << 30,
                    device_free: 1 << 29,
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        };
        let oom = out_of_memory(panic.clone(), &record, &FailedCell::default());
        assert_eq!(oom.ename, "OutOfMemory");
        assert!(oom.evalue.contains("1 OOM)") && oom.evalue.contains("limit: 80.0 GiB"));
        assert!(oom.evalue.contains("%%optimize"));
        assert!(
            oom.evalue
                .contains("was for 2.0 GiB, with 512.0 MiB free on the device"),
            "{}",
            oom.evalue
        );
        assert!(oom.traceback.last().unwrap().contains("CUDA out of memory"));
        // Not counted (the process's first CUDA allocation): libtorch's message still tells.
        record.cuda.as_mut().unwrap().ooms = 0;
        let oom = out_of_memory(panic.clone(), &record, &FailedCell::default());
        assert!(
            oom.evalue.contains("libtorch refused the allocation"),
            "{}",
            oom.evalue
        );
        // Neither counted nor said: the error stays what it was.
        let other = CellError::new("Panic", "index out of bounds");
        assert_eq!(
            out_of_memory(other.clone(), &record, &FailedCell::default()),
            other
        );
    }

    #[test]
    fn a_cpu_allocation_failure_is_an_out_of_memory_error() {
        let panic = CellError::new(
            "Panic",
            "Internal torch error: [enforce fail at alloc_cpu.cpp:121] data. \
             DefaultCPUAllocator: can't allocate memory: you tried to allocate 4 bytes.",
        );
        let oom = out_of_memory(panic, &MemoryRecord::default(), &FailedCell::default());
        assert_eq!(oom.ename, "OutOfMemory");
        assert!(oom.evalue.contains("CPU allocator"), "{}", oom.evalue);
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
        );
        assert_eq!(crash.ename, "ChildProcessCrashed");
        assert!(
            crash.evalue.contains("variables were lost") && crash.evalue.contains("signal: 11")
        );
        let interrupt = from_evcxr(
            EvcxrError::SubprocessTerminated(String::new()),
            "",
            Termination::Interrupted,
        );
        assert_eq!(interrupt.ename, "Interrupted");
    }
}
