//! What the job thread shares with the engine's handle: reachable while a cell runs, so that an
//! interrupt can stop the process running it.

use std::process::Child;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

/// State shared with the engine thread that must be reachable while it is busy.
#[derive(Default)]
pub struct Control {
    /// A cell is running. A mutex, not an atomic: interrupt checks it and kills the child while
    /// holding it, so a cell that just finished cannot lose its process to a late interrupt.
    pub running: Mutex<bool>,
    /// Set by an interrupt; the cell that ends next reports it.
    pub interrupt_requested: AtomicBool,
    /// The process running cells (evcxr's handle), once it exists.
    child: Mutex<Option<Arc<Mutex<Child>>>>,
}

impl Control {
    /// Calls `f` with the child process now running cells, if there is one (locks tolerate
    /// poison: a panic elsewhere must not keep an interrupt from the child).
    pub fn with_child<T>(&self, f: impl FnOnce(&mut Child) -> T) -> Option<T> {
        let child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        let mut child = child.as_ref()?.lock().unwrap_or_else(|e| e.into_inner());
        Some(f(&mut child))
    }

    /// The id of the child process now running cells.
    pub fn child_pid(&self) -> Option<u32> {
        self.with_child(|child| child.id())
    }

    /// Makes `child` the process that interrupts reach.
    pub fn set_child(&self, child: Arc<Mutex<Child>>) {
        *self.child.lock().unwrap_or_else(|e| e.into_inner()) = Some(child);
    }

    /// Marks whether a cell is running.
    pub fn set_running(&self, running: bool) {
        *self.running.lock().unwrap_or_else(|e| e.into_inner()) = running;
    }
}
