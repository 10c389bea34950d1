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
use crate::cuda_stats::{self, DEVICE};
use crate::state::{self, Phases};
use crate::{categories, timeline, watch};
use tchmem_wire::timeline::Phase;

fn phases() -> std::sync::MutexGuard<'static, Phases> {
    state::lock(&state::shared().phases)
}

fn allocated() -> Option<u64> {
    cuda_stats::device_stats(DEVICE)
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
    compare::at_step_start();
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
    let known = watch::known_bytes(Device::Cuda(DEVICE as usize));
    let mut categories = categories::known(known);
    let activations = now.saturating_sub(start);
    categories.push(Category {
        name: CategoryName::Activations,
        bytes: activations,
        exact: false,
        how: "allocated bytes the forward pass added (phase::forward → phase::backward)".into(),
    });
    if phases.optimizer_state > 0 {
        categories.push(categories::optimizer_state(phases.optimizer_state));
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
    crate::interrupt::run_state()
        .optimizer_steps
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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

/// Starts a cell: forgets the previous cell's backward snapshot.
pub(crate) fn before_cell() {
    let mut phases = phases();
    phases.at_backward = None;
    phases.forward_start = None;
    phases.step_start = None;
}
