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
    let before = self::before().take();
    match cuda_stats::device_stats(DEVICE) {
        Ok(stats) => cuda_record(stats, before),
        Err(why) => cpu_record(why),
    }
}

fn context_at_start() -> Option<u64> {
    *crate::shared::shared()
        .context_at_start
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Measures the CUDA context on its own: initialises CUDA and cuBLAS with a small matmul and its
/// backward, frees them and the allocator's cache, and reads this process's NVML usage, which
/// minus the allocator's reserved bytes (normally none) is then the context. Records later compare NVML usage with
/// it. Does nothing without CUDA or NVML. The kernel calls it when a session starts.
pub fn measure_context() -> Option<u64> {
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
    let reserved = cuda_stats::device_stats(DEVICE).ok()?.current.reserved;
    let process = nvml::process_bytes(DEVICE as u32).ok()?;
    let context = process.saturating_sub(reserved);
    *crate::shared::shared()
        .context_at_start
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = Some(context);
    Some(context)
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
        context_at_start: context_at_start(),
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
        bytes: stats.current.allocated.saturating_sub(counted),
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
    if let Some(process) = nvml_process {
        categories.push(Category {
            name: CategoryName::CudaContext,
            bytes: process.saturating_sub(stats.current.reserved),
            exact: false,
            how: match context_at_start() {
                Some(context) => format!(
                    "NVML process usage − allocator reserved; of this, {} MiB is the context \
                     measured at start, the rest kernels loaded since and library workspaces",
                    context >> 20
                ),
                None => "NVML process usage − allocator reserved".into(),
            },
        });
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
