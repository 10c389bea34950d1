//! What the kernel asks of whatever runs cells: the engine, or a fake in the kernel's tests.

use tokio::sync::oneshot;

use crate::engine::{CellIo, CellOutcome, CompletionOutcome, Engine, InspectOutcome};

/// Runs cells and answers code questions; every answer comes back through a oneshot channel, so
/// the async kernel never blocks on a cell.
pub trait Evaluator: Clone + Send + Sync + 'static {
    /// Runs a cell; its outputs go to `io` while it runs.
    fn execute(&self, code: String, io: CellIo) -> oneshot::Receiver<CellOutcome>;
    /// Completions at `cursor` (a character index).
    fn complete(&self, code: String, cursor: usize) -> oneshot::Receiver<CompletionOutcome>;
    /// Documentation for what is at `cursor` (a character index).
    fn inspect(&self, code: String, cursor: usize) -> oneshot::Receiver<InspectOutcome>;
    /// Stops the running cell, if any; whether one was running.
    fn interrupt(&self) -> bool;
}

impl Evaluator for Engine {
    fn execute(&self, code: String, io: CellIo) -> oneshot::Receiver<CellOutcome> {
        Engine::execute(self, code, io)
    }

    fn complete(&self, code: String, cursor: usize) -> oneshot::Receiver<CompletionOutcome> {
        Engine::complete(self, code, cursor)
    }

    fn inspect(&self, code: String, cursor: usize) -> oneshot::Receiver<InspectOutcome> {
        Engine::inspect(self, code, cursor)
    }

    fn interrupt(&self) -> bool {
        Engine::interrupt(self)
    }
}
