//! A cell that ran out of memory: an `OutOfMemory` error that says where memory stood, what was
//! alive at the failure and what to try, ranked.

use super::{display_sink, Cells, Runner};
use crate::fit::diagnosis::{diagnose, measured_fixes, FailedCell};
use crate::magics::CellMagicSource;
use crate::report::fit::LiveTable;
use crate::report::format::human_bytes;
use crate::rewrite;
use crate::rewrite::Options;
use crate::session::{CellError, ErrorName, OutputSink};
use tchmem_wire::memory::MemoryRecord;

/// What the OOM diagnosis reads from a cell (only cells that could be training loops are parsed).
pub(super) fn failed_cell(code: &str) -> FailedCell {
    if !code.contains("backward") {
        return Default::default();
    }
    let facts = rewrite::training_facts(code);
    FailedCell {
        batch: rewrite::batch::find(code).ok(),
        optimizer: facts.optimizer.map(|(name, _)| name),
        trains: facts.trains,
    }
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
pub(super) fn out_of_memory(
    error: CellError,
    record: &MemoryRecord,
    cell: &FailedCell,
) -> CellError {
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
    let mut oom = CellError::new(ErrorName::OutOfMemory, message);
    oom.traceback
        .push(format!("{}: {}", error.ename, error.evalue));
    oom
}

impl<R: Runner> Cells<R> {
    /// After a CUDA OOM in a training cell: two calibration trials at smaller batches and the
    /// fixes they predict, as text for the error (`None` when the cell cannot be tried: no batch
    /// binding, no VarStore of its own, no CUDA, or the trials did not run).
    pub(super) fn measured_oom_fixes(&mut self, code: &str, output: &OutputSink) -> Option<String> {
        let source = CellMagicSource {
            line: "",
            body: code,
            body_offset: 0,
        };
        let cell = self.training_cell(&source, "the OOM diagnosis").ok()?;
        let limit = self.device_room()?.allocator_limit();
        let mut table = LiveTable::new(
            format!("tchmem-oom-{}", self.runs),
            "The OOM, measured: short trials of the cell at smaller batches".into(),
            display_sink(output),
        );
        let calibration =
            match self.calibrate(&cell, &Options::default(), cell.binding.value, &mut table) {
                Ok(Ok(calibration)) => calibration,
                _ => return None,
            };
        let batches: Vec<String> = calibration
            .points
            .iter()
            .map(|(b, _)| b.to_string())
            .collect();
        let begin = calibration.points.last()?.1.begin;
        let rule = cell.rule;
        let (needed, fixes) = measured_fixes(&calibration, &cell.binding, rule, begin, limit);
        let mut text = format!(
            "\nMeasured (trials at {} = {}, the table above): at {} the loop needs about {} \
             reserved; the allocator may take {}.",
            cell.binding.name,
            batches.join(" and "),
            cell.binding.value,
            human_bytes(needed),
            human_bytes(limit)
        );
        for (i, fix) in fixes.iter().enumerate() {
            text.push_str(&format!(
                "\n  {}. {:<36} {}{}",
                i + 1,
                fix.line,
                fix.why,
                if fix.covers { "" } else { ": does not fit" }
            ));
        }
        Some(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tchmem_wire::memory::CudaMemory;

    #[test]
    fn an_oom_counted_by_the_allocator_becomes_an_out_of_memory_error() {
        let panic = CellError::new(ErrorName::Panic, "Internal torch error: CUDA out of memory");
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
        assert_eq!(oom.ename, ErrorName::OutOfMemory);
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
        let other = CellError::new(ErrorName::Panic, "index out of bounds");
        assert_eq!(
            out_of_memory(other.clone(), &record, &FailedCell::default()),
            other
        );
    }

    #[test]
    fn a_cpu_allocation_failure_is_an_out_of_memory_error() {
        let panic = CellError::new(
            ErrorName::Panic,
            "Internal torch error: [enforce fail at alloc_cpu.cpp:121] data. \
             DefaultCPUAllocator: can't allocate memory: you tried to allocate 4 bytes.",
        );
        let oom = out_of_memory(panic, &MemoryRecord::default(), &FailedCell::default());
        assert_eq!(oom.ename, ErrorName::OutOfMemory);
        assert!(oom.evalue.contains("CPU allocator"), "{}", oom.evalue);
    }
}
