//! Phase markers of a training step, from which the runtime tells activations and optimizer
//! state apart, and a measured run (`tchmem::compare`) its peak per phase (CUDA: they read the
//! allocator's counters; elsewhere they do nothing).
//!
//! ```no_run
//! # use tch::{nn, nn::Module, nn::OptimizerConfig, Tensor};
//! # let vs = nn::VarStore::new(tch::Device::Cpu);
//! # let model = nn::linear(vs.root(), 4, 1, Default::default());
//! # let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
//! # let x = Tensor::zeros([2, 4], (tch::Kind::Float, tch::Device::Cpu));
//! let loss = tchmem::phase::train_step(&mut opt, || model.forward(&x).mean(tch::Kind::Float));
//! ```

use tch::nn::Optimizer;
use tch::{Device, Tensor};
use tchmem_wire::memory::{Category, CategoryName};

use crate::compare::{self, Part};
use crate::{cuda_stats, timeline, watch};
use tchmem_wire::timeline::Phase;

/// What the markers measured.
#[derive(Default)]
pub struct Phases {
    forward_start: Option<u64>,
    step_start: Option<u64>,
    /// Largest growth of allocated bytes across an optimizer step (the first step creates the
    /// state); kept while a watched model is alive.
    pub optimizer_state: u64,
    /// Categories at the start of the last backward pass of the running cell.
    pub at_backward: Option<Vec<Category>>,
}

fn phases() -> std::sync::MutexGuard<'static, Phases> {
    crate::shared::shared()
        .phases
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

fn allocated() -> Option<u64> {
    cuda_stats::device_stats(crate::record::DEVICE)
        .ok()
        .map(|s| s.current.allocated)
}

/// Marks the start of making or moving the input batch (only timelines use it).
pub fn data() {
    timeline::mark(Phase::Data);
}

/// Marks the start of the forward pass.
pub fn forward() {
    timeline::mark(Phase::Forward);
    compare::at_marker(Some(Part::ForwardBackward));
    phases().forward_start = allocated();
}

/// Marks the start of the backward pass (the loss is computed): what the forward pass left
/// allocated is the activations (and the loss).
pub fn backward() {
    timeline::mark(Phase::Backward);
    compare::at_marker(Some(Part::ForwardBackward));
    let Some(now) = allocated() else { return };
    let mut phases = phases();
    let Some(start) = phases.forward_start.take() else {
        return;
    };
    let known = watch::known_bytes(Device::Cuda(crate::record::DEVICE as usize));
    let mut categories = crate::record::known_categories(known);
    let activations = now.saturating_sub(start);
    categories.push(Category {
        name: CategoryName::Activations,
        bytes: activations,
        exact: false,
        how: "allocated bytes the forward pass added (phase::forward → phase::backward)".into(),
    });
    if phases.optimizer_state > 0 {
        categories.push(optimizer_category(phases.optimizer_state));
    }
    let counted: u64 = categories.iter().map(|c| c.bytes).sum();
    categories.push(Category {
        name: CategoryName::Other,
        bytes: now.saturating_sub(counted),
        exact: false,
        how: "allocated bytes minus the categories above".into(),
    });
    phases.at_backward = Some(categories);
}

/// Marks the optimizer step (after backward, before `opt.step()`).
pub fn step() {
    timeline::mark(Phase::Step);
    compare::at_marker(Some(Part::Step));
    phases().step_start = allocated();
}

/// Marks the end of the optimizer step.
pub fn end() {
    compare::at_marker(None);
    if let Some(now) = allocated() {
        let mut phases = phases();
        if let Some(start) = phases.step_start.take() {
            phases.optimizer_state = phases.optimizer_state.max(now.saturating_sub(start));
        }
    }
    timeline::step_ended();
}

/// One training step with every marker in place: forward (`loss`), backward, optimizer step.
/// Returns the loss.
pub fn train_step(opt: &mut Optimizer, loss: impl FnOnce() -> Tensor) -> Tensor {
    forward();
    let loss = loss();
    backward();
    opt.zero_grad();
    loss.backward();
    step();
    opt.step();
    end();
    loss
}

/// The optimizer-state category for `bytes`.
pub fn optimizer_category(bytes: u64) -> Category {
    Category {
        name: CategoryName::OptimizerState,
        bytes,
        exact: false,
        how: "growth of allocated bytes across the first optimizer step \
              (phase::step → phase::end), where optimizers create their state"
            .into(),
    }
}

/// Forgets the optimizer-state estimate (when no watched model is alive any more).
pub(crate) fn forget_optimizer_state() {
    phases().optimizer_state = 0;
}

/// Starts a cell: forgets the previous cell's backward snapshot.
pub(crate) fn before_cell() {
    let mut phases = phases();
    phases.at_backward = None;
    phases.forward_start = None;
    phases.step_start = None;
}

/// The optimizer state estimate and the backward snapshot of the cell that just ran.
pub(crate) fn after_cell() -> (u64, Option<Vec<Category>>) {
    let mut phases = phases();
    (phases.optimizer_state, phases.at_backward.take())
}
