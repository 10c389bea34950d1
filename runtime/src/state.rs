//! The runtime's process-wide state, shared by the copies of this crate in every cell: plain
//! data, its one owner ([`shared`]) and one poison-tolerant [`lock`]. It imports no other module
//! of the runtime, so every module may use it.
//!
//! Inside the tchmem kernel, each cell links its own copy of this crate (evcxr links
//! dependencies statically), so a plain `static` would be per cell. The first copy that needs
//! the state creates it and leaves it in the kernel child's [`ChildSlot`]; later copies find it
//! there. Outside the kernel (tests, programs) there is one copy and a local static serves.

use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::{Mutex, MutexGuard, OnceLock, TryLockError, Weak};

use tch::nn::Variables;
use tch::Tensor;
use tchmem_wire::memory::{Category, Counters, OomEvent};
use tchmem_wire::timeline::{TimelineCapture, TimelineRequest};
use tchmem_wire::{ChildSlot, CHILD_SLOT_SYMBOL};

/// Locks `mutex`, tolerating poison: a panic in a cell that held a lock must not take the
/// runtime's state with it.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// Locks `mutex` if it is free (tolerating poison); `None` when another thread holds it (inside
/// libtorch's OOM observer, which must never block).
pub(crate) fn try_lock<T>(mutex: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match mutex.try_lock() {
        Ok(guard) => Some(guard),
        Err(TryLockError::Poisoned(e)) => Some(e.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

/// The watched stores and batch (see `watch`).
#[derive(Default)]
pub struct Watched {
    /// The variables of each watched VarStore, while the store lives.
    pub(crate) stores: Vec<Weak<Mutex<Variables>>>,
    /// The tensor given to `watch_batch`.
    pub(crate) batch: Option<Tensor>,
}

/// Counters noted before a cell (see `record`).
pub struct Before {
    /// The allocator's counters.
    pub(crate) counters: Counters,
    /// Allocations made since the process started.
    pub(crate) allocations: i64,
    /// Cache-flush-and-retry events.
    pub(crate) alloc_retries: i64,
    /// Out-of-memory errors.
    pub(crate) ooms: i64,
}

/// What the training-step markers measured (see `phase`).
#[derive(Default)]
pub struct Phases {
    /// Allocated bytes at the last `phase::forward`.
    pub(crate) forward_start: Option<u64>,
    /// Allocated bytes at the last `phase::step`.
    pub(crate) step_start: Option<u64>,
    /// Largest growth of allocated bytes across an optimizer step (the first step creates the
    /// state); kept while a watched model is alive.
    pub optimizer_state: u64,
    /// Categories at the start of the last backward pass of the running cell.
    pub at_backward: Option<Vec<Category>>,
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

/// A timeline being recorded (see `timeline`).
pub struct Recording {
    /// What the kernel asked for.
    pub(crate) request: TimelineRequest,
    /// What is captured so far.
    pub(crate) capture: TimelineCapture,
    /// Recording was stopped (after `--steps` steps) and the snapshot already written.
    pub(crate) stopped: bool,
}

/// Operator recordings kept for the estimate's replay (see `op_trace`): C++ objects made by
/// one cell's copy of the shim and replayed by another's.
#[derive(Default)]
pub struct OpRecordings {
    /// The identifier the next recording gets.
    pub(crate) next_id: u64,
    /// The newest recordings, by identifier: the address of each C++ object.
    pub(crate) kept: std::collections::VecDeque<(u64, usize)>,
    /// libtorch's handle of the callback of a recording under way.
    pub(crate) recording: Option<u64>,
}

/// The process group this process joined (see dist/): a C++ object made by one cell's copy of
/// the shim and used by every later cell's.
#[derive(Debug, Clone, Copy)]
pub struct DistGroup {
    /// This process's rank.
    pub(crate) rank: usize,
    /// How many ranks the group has.
    pub(crate) world_size: usize,
    /// The address of the group (a `c10::intrusive_ptr<c10d::Backend>` on the heap).
    pub(crate) address: usize,
}

/// What the session start measured, if it ran on CUDA.
pub(crate) fn at_start() -> Option<AtStart> {
    *lock(&shared().at_start)
}

/// Everything the runtime remembers between cells.
pub struct Shared {
    /// Watched stores and batch.
    pub watched: Mutex<Watched>,
    /// Counters noted before the running cell.
    pub before: Mutex<Option<Before>>,
    /// What the training-step markers measured.
    pub phases: Mutex<Phases>,
    /// The CUDA context and library workspaces measured when the session started (see
    /// record::measure_context).
    pub at_start: Mutex<Option<AtStart>>,
    /// What the OOM observer reported since the running cell began (see oom.rs).
    pub oom_events: Mutex<Vec<OomEvent>>,
    /// The allocation timeline being recorded (see timeline.rs).
    pub timeline: Mutex<Option<Recording>>,
    /// Operator recordings kept for a replay (see op_trace.rs).
    pub op_recordings: Mutex<OpRecordings>,
    /// The address of the process's allocation log, 0 before it is made (see alloc_trace.rs).
    pub alloc_log: Mutex<usize>,
    /// The process group this process is a rank of (see dist/).
    pub dist: Mutex<Option<DistGroup>>,
}

/// Identifies this build's `Shared` layout: copies built from other sources must not share it.
fn tag() -> u64 {
    let text = concat!(env!("CARGO_PKG_VERSION"), file!(), line!());
    text.bytes().fold(0xcbf29ce484222325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    }) ^ std::mem::size_of::<Shared>() as u64
}

/// The kernel child's slot, when running inside the kernel.
pub fn child_slot() -> Option<&'static ChildSlot> {
    // SAFETY: dlsym with RTLD_DEFAULT looks a symbol up in the process; the child defines it as
    // `extern "C" fn() -> *const ChildSlot` returning a pointer to a static.
    unsafe {
        let symbol = libc::dlsym(libc::RTLD_DEFAULT, CHILD_SLOT_SYMBOL.as_ptr());
        if symbol.is_null() {
            return None;
        }
        let get: extern "C" fn() -> *const ChildSlot = std::mem::transmute(symbol);
        get().as_ref()
    }
}

/// The shared state.
pub fn shared() -> &'static Shared {
    static STATE: OnceLock<&'static Shared> = OnceLock::new();
    STATE.get_or_init(|| {
        let fresh = || -> &'static Shared {
            Box::leak(Box::new(Shared {
                watched: Mutex::new(Watched::default()),
                before: Mutex::new(None),
                phases: Mutex::new(Phases::default()),
                at_start: Mutex::new(None),
                oom_events: Mutex::new(Vec::new()),
                timeline: Mutex::new(None),
                op_recordings: Mutex::new(OpRecordings::default()),
                alloc_log: Mutex::new(0),
                dist: Mutex::new(None),
            }))
        };
        let Some(slot) = child_slot() else {
            return fresh();
        };
        let existing = slot.state.load(Ordering::Acquire);
        if !existing.is_null() {
            if slot.state_tag.load(Ordering::Acquire) == tag() {
                // SAFETY: created below by a copy of this same build (same tag).
                return unsafe { &*(existing as *const Shared) };
            }
            return fresh();
        }
        let created = fresh();
        let pointer = created as *const Shared as *mut c_void;
        match slot.state.compare_exchange(
            std::ptr::null_mut(),
            pointer,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => {
                slot.state_tag.store(tag(), Ordering::Release);
                created
            }
            // Another copy got there first: use its state (ours is leaked, a few bytes).
            // SAFETY: as above; the tag check keeps other builds out.
            Err(winner) if slot.state_tag.load(Ordering::Acquire) == tag() => unsafe {
                &*(winner as *const Shared)
            },
            Err(_) => created,
        }
    })
}
