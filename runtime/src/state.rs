//! The runtime's process-wide state, shared by the copies of this crate in every cell.
//!
//! Inside the tchmem kernel, each cell links its own copy of this crate (evcxr links
//! dependencies statically), so a plain `static` would be per cell. The first copy that needs
//! the state creates it and leaves it in the kernel child's [`ChildSlot`]; later copies find it
//! there. Outside the kernel (tests, programs) there is one copy and a local static serves.

use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::{Mutex, OnceLock};

use tchmem_wire::{ChildSlot, CHILD_SLOT_SYMBOL};

use crate::phase::Phases;
use crate::record::Before;
use crate::watch::Watched;

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
    pub at_start: Mutex<Option<crate::record::AtStart>>,
    /// What the OOM observer reported since the running cell began (see oom.rs).
    pub oom_events: Mutex<Vec<tchmem_wire::memory::OomEvent>>,
    /// The allocation timeline being recorded (see timeline.rs).
    pub timeline: Mutex<Option<crate::timeline::Active>>,
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
