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
    pub child: Mutex<Option<Arc<Mutex<Child>>>>,
}

impl Control {
    /// The id of the child process now running cells.
    pub fn child_pid(&self) -> Option<u32> {
        let child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        let child = child.as_ref()?.lock().unwrap_or_else(|e| e.into_inner());
        Some(child.id())
    }

    /// Marks whether a cell is running.
    pub fn set_running(&self, running: bool) {
        *self.running.lock().unwrap_or_else(|e| e.into_inner()) = running;
    }
}
