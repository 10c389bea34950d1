//! Per-cell memory records, taken by the kernel's child process around every cell through the
//! two `extern "C"` hooks at the bottom (found by symbol, so no compile is needed per cell).

use std::ffi::{c_char, CString};

use tch::Device;
use tchmem_wire::memory::{Category, CategoryName, Counters, CudaMemory, MemoryRecord};

use crate::{cuda_stats, nvml, watch};

/// The CUDA device the records describe.
pub(crate) const DEVICE: i64 = 0;

/// Counters noted before a cell.
pub struct Before {
    counters: Counters,
    allocations: i64,
    alloc_retries: i64,
    ooms: i64,
}

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

fn before() -> std::sync::MutexGuard<'static, Option<Before>> {
    crate::shared::shared()
        .before
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Starts a cell: resets the allocator's peaks and remembers the counters.
pub fn before_cell() {
    let before = cuda_stats::device_stats(DEVICE)
        .ok()
        .map(|stats| Before::from(&stats));
    if before.is_some() {
        let _ = cuda_stats::reset_peak_stats(DEVICE);
    }
    crate::phase::before_cell();
    crate::oom::take_events();
    *self::before() = before;
}

/// Ends a cell: the record of what it did.
pub fn after_cell() -> MemoryRecord {
    // First, so that the counters below include what the cell's last kernels freed.
    let timeline = crate::timeline::finish();
    let before = self::before().take();
    let mut record = match cuda_stats::device_stats(DEVICE) {
        Ok(stats) => cuda_record(stats, before),
        Err(why) => cpu_record(why),
    };
    record.timeline = timeline;
    record
}

/// What the session start measured on the device, before any cell ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AtStart {
    /// NVML process usage minus the allocator's reserved bytes: the CUDA context on its own.
    pub context: u64,
    /// Bytes still allocated once the cache was emptied: cuBLAS's workspace, which the
    /// allocator hands out like a tensor but which belongs with the context.
    pub workspace: u64,
}

pub(crate) fn at_start() -> Option<AtStart> {
    *crate::shared::shared()
        .at_start
        .lock()
        .unwrap_or_else(|e| e.into_inner())
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
    *crate::shared::shared()
        .at_start
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = Some(measured);
    Some(measured)
}

/// The memory as it is now, without a cell around it.
pub fn current() -> MemoryRecord {
    match cuda_stats::device_stats(DEVICE) {
        Ok(stats) => cuda_record(stats, None),
        Err(why) => cpu_record(why),
    }
}

fn cuda_record(stats: cuda_stats::DeviceStats, before: Option<Before>) -> MemoryRecord {
    let mut notes = Vec::new();
    let start = at_start();
    let workspace = start.map_or(0, |s| s.workspace);
    let (device_free, device_total) = cuda_stats::memory_info(DEVICE).unwrap_or_else(|why| {
        notes.push(format!("cudaMemGetInfo failed: {why}"));
        (0, 0)
    });
    let nvml_process = nvml::process_bytes(DEVICE as u32)
        .map_err(|why| notes.push(why))
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
    let mut categories = known_categories(known);
    if known.stores == 0 {
        // The model is gone, and with it (as far as we can tell) its optimizer.
        crate::phase::forget_optimizer_state();
    }
    let (optimizer_state, at_backward) = crate::phase::after_cell();
    if optimizer_state > 0 {
        categories.push(crate::phase::optimizer_category(optimizer_state));
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
        timeline: None,
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

fn cpu_record(why: String) -> MemoryRecord {
    let known = watch::known_bytes(Device::Cpu);
    MemoryRecord {
        device: "cpu".into(),
        cuda: None,
        categories: known_categories(known),
        at_backward: None,
        notes: vec![format!(
            "No allocator counters: {why}. On CPU the categories come from the watched tensors' \
             sizes; peaks, fragmentation and the CUDA context are CUDA-only."
        )],
        recording_seconds: None,
        wall_seconds: None,
        timeline: None,
    }
}

pub(crate) fn known_categories(known: watch::Known) -> Vec<Category> {
    let mut categories = Vec::new();
    if known.stores > 0 {
        categories.push(Category {
            name: CategoryName::Parameters,
            bytes: known.parameters,
            exact: true,
            how: format!(
                "sizes of the variables of {} watched VarStore(s)",
                known.stores
            ),
        });
        categories.push(Category {
            name: CategoryName::Gradients,
            bytes: known.gradients,
            exact: true,
            how: "sizes of the defined .grad() of trainable variables".into(),
        });
    }
    if known.input_batch > 0 {
        categories.push(Category {
            name: CategoryName::InputBatch,
            bytes: known.input_batch,
            exact: true,
            how: "size of the tensor given to tchmem::watch_batch".into(),
        });
    }
    categories
}

/// Gives the kernel's child this runtime's hooks (called when a session starts).
pub(crate) fn register_hooks() {
    use std::sync::atomic::Ordering;
    if let Some(slot) = crate::shared::child_slot() {
        let before: extern "C" fn() = tchmem_runtime_before_cell;
        let after: extern "C" fn() -> *mut c_char = tchmem_runtime_after_cell;
        let free: unsafe extern "C" fn(*mut c_char) = tchmem_runtime_free;
        slot.before_cell.store(before as *mut _, Ordering::Release);
        slot.after_cell.store(after as *mut _, Ordering::Release);
        slot.free.store(free as *mut _, Ordering::Release);
    }
}

/// Hook for the kernel's child: before a cell.
pub extern "C" fn tchmem_runtime_before_cell() {
    let _ = std::panic::catch_unwind(before_cell);
}

/// Hook for the kernel's child: after a cell; returns the record as JSON, to be released with
/// [`tchmem_runtime_free`]. Null if measuring failed.
pub extern "C" fn tchmem_runtime_after_cell() -> *mut c_char {
    std::panic::catch_unwind(|| {
        let json = serde_json::to_string(&after_cell()).ok()?;
        CString::new(json).ok()
    })
    .ok()
    .flatten()
    .map_or(std::ptr::null_mut(), CString::into_raw)
}

/// Releases a string returned by [`tchmem_runtime_after_cell`].
///
/// # Safety
/// `text` must come from [`tchmem_runtime_after_cell`] and be released once.
pub unsafe extern "C" fn tchmem_runtime_free(text: *mut c_char) {
    if !text.is_null() {
        drop(CString::from_raw(text));
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
