//! Memory records: what the allocator's counters, NVML and the watched tensors say now, split
//! into categories (the hooks in `hooks` take one around every cell).

use tch::Device;
use tchmem_wire::memory::{Category, CategoryName, CudaMemory, MemoryRecord};

pub use crate::state::AtStart;

use crate::cuda_stats::{self, DEVICE};
use crate::error::RuntimeError;
use crate::state::{self, Before};
use crate::{categories, nvml, watch};

impl From<&cuda_stats::DeviceStats> for Before {
    fn from(stats: &cuda_stats::DeviceStats) -> Self {
        Before {
            counters: stats.current,
            allocations: stats.allocations,
            alloc_retries: stats.alloc_retries,
            ooms: stats.ooms,
        }
    }
}

/// Measures the CUDA context on its own: initialises CUDA and cuBLAS with a small matmul and its
/// backward, frees them and the allocator's cache, and reads this process's NVML usage, which
/// minus the allocator's reserved bytes is then the context. What stays allocated (cuBLAS's
/// workspace) is remembered too, so that records count it as context + workspace rather than
/// as the first cell's tensors. Does nothing without CUDA. The kernel calls it when a session
/// starts.
pub fn measure_context() -> Option<AtStart> {
    if !tch::Cuda::is_available() {
        return None;
    }
    // CUDA, and cuBLAS with its handle (every model's first matmul loads it), on their own.
    {
        let a = tch::Tensor::ones([64, 64], (tch::Kind::Float, Device::Cuda(DEVICE as usize)))
            .set_requires_grad(true);
        a.matmul(&a).sum(tch::Kind::Float).backward();
    }
    tch::Cuda::synchronize(DEVICE);
    cuda_stats::empty_cache().ok()?;
    let current = cuda_stats::device_stats(DEVICE).ok()?.current;
    // Without NVML the workspace is still known; the context then is not.
    let context = nvml::process_bytes(DEVICE as u32)
        .map(|process| process.saturating_sub(current.reserved))
        .unwrap_or(0);
    let measured = AtStart {
        context,
        workspace: current.allocated,
    };
    *state::lock(&state::shared().at_start) = Some(measured);
    Some(measured)
}

/// The memory as it is now, without a cell around it.
pub fn current() -> MemoryRecord {
    match cuda_stats::device_stats(DEVICE) {
        Ok(stats) => cuda_record(stats, None),
        Err(why) => cpu_record(why),
    }
}

pub(crate) fn cuda_record(stats: cuda_stats::DeviceStats, before: Option<Before>) -> MemoryRecord {
    let mut notes = Vec::new();
    let start = state::at_start();
    let workspace = start.map_or(0, |s| s.workspace);
    let (device_free, device_total) = cuda_stats::memory_info(DEVICE).unwrap_or_else(|why| {
        notes.push(format!("cudaMemGetInfo failed: {why}"));
        (0, 0)
    });
    let nvml_process = nvml::process_bytes(DEVICE as u32)
        .map_err(|why| notes.push(why.to_string()))
        .ok();
    // Without a before-cell snapshot the cell counts as having changed nothing.
    let before = before.unwrap_or_else(|| Before::from(&stats));
    let cuda = CudaMemory {
        device: DEVICE,
        before: before.counters,
        after: stats.current,
        peak: stats.peak,
        allocations: stats.allocations - before.allocations,
        alloc_retries: stats.alloc_retries - before.alloc_retries,
        ooms: stats.ooms - before.ooms,
        device_total,
        device_free,
        nvml_process,
        context_at_start: start.map(|s| s.context).filter(|&c| c > 0),
        workspace_at_start: start.map(|s| s.workspace),
        oom_events: crate::oom::take_events(),
    };
    let known = watch::known_bytes(Device::Cuda(DEVICE as usize));
    let mut categories = categories::known(known);
    let (optimizer_state, at_backward) = {
        let mut phases = state::lock(&state::shared().phases);
        if known.stores == 0 {
            // The model is gone, and with it (as far as we can tell) its optimizer.
            phases.optimizer_state = 0;
        }
        (phases.optimizer_state, phases.at_backward.take())
    };
    if optimizer_state > 0 {
        categories.push(categories::optimizer_state(optimizer_state));
    }
    let counted: u64 = categories.iter().map(|c| c.bytes).sum();
    categories.push(Category {
        name: CategoryName::Other,
        bytes: stats
            .current
            .allocated
            .saturating_sub(counted)
            .saturating_sub(workspace),
        exact: false,
        how: if optimizer_state > 0 {
            "allocated bytes minus the categories above".into()
        } else {
            "allocated bytes minus the categories above: optimizer state and other tensors \
             (mark the step with tchmem::phase to tell them apart)"
                .into()
        },
    });
    categories.push(Category {
        name: CategoryName::Fragmentation,
        bytes: stats
            .current
            .reserved
            .saturating_sub(stats.current.allocated),
        exact: true,
        how: "allocator: reserved − allocated".into(),
    });
    if let Some(category) = context_category(nvml_process, stats.current.reserved, start) {
        categories.push(category);
    }
    MemoryRecord {
        device: format!("cuda:{DEVICE}"),
        cuda: Some(cuda),
        categories,
        at_backward,
        notes,
        recording_seconds: None,
        wall_seconds: None,
    }
}

/// "CUDA context + workspace": NVML's usage beyond the allocator's reserved bytes, plus the
/// workspace the session start left allocated (inside reserved, so not counted twice).
fn context_category(
    nvml_process: Option<u64>,
    reserved: u64,
    start: Option<AtStart>,
) -> Option<Category> {
    let workspace = start.map_or(0, |s| s.workspace);
    let workspace_note = if workspace > 0 {
        format!(
            ", plus {} MiB of cuBLAS workspace allocated at session start",
            workspace >> 20
        )
    } else {
        String::new()
    };
    let (bytes, how) = match (nvml_process, start) {
        (Some(process), Some(start)) if start.context > 0 => (
            process.saturating_sub(reserved) + workspace,
            format!(
                "NVML process usage − allocator reserved{workspace_note}; of this, {} MiB is \
                 the context measured at start, the rest kernels loaded since and library \
                 workspaces",
                start.context >> 20
            ),
        ),
        (Some(process), _) => (
            process.saturating_sub(reserved) + workspace,
            format!("NVML process usage − allocator reserved{workspace_note}"),
        ),
        (None, _) if workspace > 0 => (
            workspace,
            "cuBLAS workspace allocated at session start (no NVML: the context is unknown)".into(),
        ),
        (None, _) => return None,
    };
    Some(Category {
        name: CategoryName::CudaContext,
        bytes,
        exact: false,
        how,
    })
}

pub(crate) fn cpu_record(why: RuntimeError) -> MemoryRecord {
    let known = watch::known_bytes(Device::Cpu);
    MemoryRecord {
        device: "cpu".into(),
        cuda: None,
        categories: categories::known(known),
        at_backward: None,
        notes: vec![format!(
            "No allocator counters: {why}. On CPU the categories come from the watched tensors' \
             sizes; peaks, fragmentation and the CUDA context are CUDA-only."
        )],
        recording_seconds: None,
        wall_seconds: None,
    }
}

#[cfg(test)]
mod tests {
    use super::{context_category, AtStart};

    const MIB: u64 = 1 << 20;

    #[test]
    fn the_workspace_left_at_session_start_counts_as_context_not_as_a_cells_tensors() {
        let start = AtStart {
            context: 500 * MIB,
            workspace: 64 * MIB,
        };
        // NVML sees the context and the reserved bytes, which hold the workspace.
        let category = context_category(Some(500 * MIB + 66 * MIB), 66 * MIB, Some(start)).unwrap();
        assert_eq!(category.bytes, 564 * MIB);
        assert!(category.how.contains("64 MiB of cuBLAS workspace"));
        assert!(category
            .how
            .contains("500 MiB is the context measured at start"));
    }

    #[test]
    fn without_nvml_the_workspace_alone_is_shown_and_without_either_nothing() {
        let start = AtStart {
            context: 0,
            workspace: 64 * MIB,
        };
        let category = context_category(None, 66 * MIB, Some(start)).unwrap();
        assert_eq!(category.bytes, 64 * MIB);
        assert!(context_category(None, 66 * MIB, None).is_none());
    }
}
