//! The process-wide slot shared by the kernel's child and the runtime.

/// Name of the function the kernel's child exports so that code in cells can find
/// [`ChildSlot`].
pub const CHILD_SLOT_SYMBOL: &std::ffi::CStr = c"tchmem_child_slot";

/// Process-wide meeting point between the kernel's child and the runtime.
///
/// evcxr links a cell's dependencies statically into each cell's library, so every cell has its
/// own copy of the runtime and of its statics. The child binary is loaded once per process; it
/// owns this slot and exports [`CHILD_SLOT_SYMBOL`] to reach it. The runtime keeps its state
/// behind `state` (so every cell's copy sees the same watched tensors) and registers its memory
/// hooks here for the child to call around cells. `repr(C)` with atomics only: both sides
/// agree on the layout without sharing any Rust type.
#[repr(C)]
pub struct ChildSlot {
    /// The runtime's shared state (its own type, created by the first copy that needs it).
    pub state: std::sync::atomic::AtomicPtr<std::ffi::c_void>,
    /// Tag of the runtime build that created `state`; other builds must not use it.
    pub state_tag: std::sync::atomic::AtomicU64,
    /// `extern "C" fn()`: before a cell.
    pub before_cell: std::sync::atomic::AtomicPtr<std::ffi::c_void>,
    /// `extern "C" fn() -> *mut c_char`: after a cell, the record as JSON (or null).
    pub after_cell: std::sync::atomic::AtomicPtr<std::ffi::c_void>,
    /// `extern "C" fn(*mut c_char)`: releases what `after_cell` returned.
    pub free: std::sync::atomic::AtomicPtr<std::ffi::c_void>,
    /// The running cell's interrupt request, loops and progress.
    pub run: crate::progress::RunState,
}

impl ChildSlot {
    /// An empty slot.
    pub const fn new() -> Self {
        use std::sync::atomic::{AtomicPtr, AtomicU64};
        ChildSlot {
            state: AtomicPtr::new(std::ptr::null_mut()),
            state_tag: AtomicU64::new(0),
            before_cell: AtomicPtr::new(std::ptr::null_mut()),
            after_cell: AtomicPtr::new(std::ptr::null_mut()),
            free: AtomicPtr::new(std::ptr::null_mut()),
            run: crate::progress::RunState::new(),
        }
    }
}

impl Default for ChildSlot {
    fn default() -> Self {
        Self::new()
    }
}
