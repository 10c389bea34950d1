//! The process-wide slot through which the runtime (in cells) and the child meet, and the
//! runtime's memory hooks that the child calls around every cell.
//!
//! The runtime crate is the only code that links libtorch; the child never links it. Once a cell
//! has called `tchmem::__kernel_session_start()` (the prelude does), the runtime has put its
//! hooks into [`SLOT`], which the child exports by name (see build.rs) so that every cell's copy
//! of the runtime finds the same one.

use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::Ordering;

use tchmem_wire::progress::{MemoryNow, RunState};
use tchmem_wire::AfterCell;
use tchmem_wire::ChildSlot;

static SLOT: ChildSlot = ChildSlot::new();

/// Exported for the runtime (the name is `tchmem_wire::CHILD_SLOT_SYMBOL`).
#[no_mangle]
pub extern "C" fn tchmem_child_slot() -> *const ChildSlot {
    &SLOT
}

/// The running cell's shared state (interrupt request, loops, progress).
pub fn run_state() -> &'static RunState {
    &SLOT.run
}

/// The device's memory now, from the runtime's hook (`None` without the runtime or CUDA).
pub fn sample_memory() -> Option<MemoryNow> {
    let sample = hook(&SLOT.run.sample_memory)?;
    // SAFETY: the runtime stored a `SampleFn` (runtime/src/hooks.rs); cell libraries are never
    // unloaded.
    let sample: SampleFn = unsafe { std::mem::transmute::<*mut c_void, SampleFn>(sample) };
    let mut now = MemoryNow::default();
    // SAFETY: `now` is a valid, writable MemoryNow.
    unsafe { sample(&mut now) }.then_some(now)
}

type SampleFn = unsafe extern "C" fn(*mut MemoryNow) -> bool;
type BeforeFn = extern "C" fn();
type AfterFn = extern "C" fn() -> *mut c_char;
type FreeFn = unsafe extern "C" fn(*mut c_char);

fn hook(pointer: &std::sync::atomic::AtomicPtr<c_void>) -> Option<*mut c_void> {
    let address = pointer.load(Ordering::Acquire);
    (!address.is_null()).then_some(address)
}

/// The environment variable that turns recording off when set to `0` (for measuring what
/// recording costs; cells then get no memory record).
pub const RECORD_ENV: &str = "TCHMEM_RECORD";

/// Whether the runtime's hooks run around cells (read once per child).
pub fn recording_enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var(RECORD_ENV).map_or(true, |v| v != "0"))
}

/// Calls the runtime's before-cell hook, if registered.
pub fn before_cell() {
    if let Some(before) = hook(&SLOT.before_cell) {
        // SAFETY: the runtime stored a `BeforeFn` (runtime/src/hooks.rs); cell libraries are
        // never unloaded, so the code stays valid.
        let before: BeforeFn = unsafe { std::mem::transmute::<*mut c_void, BeforeFn>(before) };
        before();
    }
}

/// The runtime's record (and timeline) of the cell that just ran; `None` if no runtime is registered.
pub fn after_cell() -> Option<Result<AfterCell, String>> {
    let after = hook(&SLOT.after_cell)?;
    let free = hook(&SLOT.free)?;
    // SAFETY: as in `before_cell`; the string is released by the runtime's own function.
    unsafe {
        let after: AfterFn = std::mem::transmute::<*mut c_void, AfterFn>(after);
        let free: FreeFn = std::mem::transmute::<*mut c_void, FreeFn>(free);
        let text = after();
        if text.is_null() {
            return Some(Err("the runtime could not measure this cell".into()));
        }
        let parsed = CStr::from_ptr(text)
            .to_str()
            .map_err(|e| e.to_string())
            .and_then(|json| serde_json::from_str(json).map_err(|e| e.to_string()));
        free(text);
        Some(parsed)
    }
}
