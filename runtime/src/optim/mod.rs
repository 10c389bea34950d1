//! Optimizers written over a VarStore's trainable variables, with tch's `nn::Optimizer` API
//! (`backward_step`, `step`, `zero_grad`, `set_lr`, `clip_grad_norm`, and the parameter groups of
//! `set_lr_group` and `set_weight_decay_group`, which tch's `nn::Path::set_group` assigns) and
//! one addition:
//! [`Optimizer::state_bytes`], the exact bytes of the state they keep (tch's C++ optimizers hide
//! theirs).
//!
//! Build one the way tch builds its own:
//!
//! ```no_run
//! # use tch::{nn, Device};
//! let vs = nn::VarStore::new(Device::Cpu);
//! let mut opt = tchmem::optim::Lion::default().build(&vs, 1e-4).unwrap();
//! ```
//!
//! The algorithms: [`Sgd`] (with momentum), [`Lion`], [`AdamW8bit`] (block-wise 8-bit moments),
//! [`Adafactor`] (factored second moment), and [`Adam`] / [`AdamW`] (tch's, on torch's fused
//! kernels). All update in place under no-grad, on any device,
//! for parameters of any float kind, and skip parameters that have no gradient.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tch::{nn, COptimizer, Kind, TchError, Tensor};

mod adafactor;
mod adam;
mod adamw8bit;
mod in_backward;
mod lion;
mod sgd;

pub use adafactor::Adafactor;
pub use adam::{Adam, AdamW};
pub use adamw8bit::AdamW8bit;
pub use in_backward::InBackward;
pub use lion::Lion;
pub use sgd::Sgd;

/// What the mixed-precision grad scaler and other helpers need from an optimizer: both tch's
/// `nn::Optimizer` and this module's [`Optimizer`] have it.
pub trait Step {
    /// Applies one update from the current gradients.
    fn step(&mut self);
    /// Clears the gradients (both tch's optimizers and ours drop them).
    fn zero_grad(&mut self);
}

impl Step for nn::Optimizer {
    fn step(&mut self) {
        nn::Optimizer::step(self)
    }
    fn zero_grad(&mut self) {
        nn::Optimizer::zero_grad(self)
    }
}

/// One optimization algorithm's update rule and state (implemented by each optimizer below).
///
/// `params` only grows between calls (variables added to the store later are appended), so an
/// algorithm may keep its per-parameter state by index.
pub trait Algorithm: Send {
    /// Updates `params` in place (under no-grad) from their gradients, each with its group's
    /// learning rate and weight decay (`hyper[i]` is `params[i]`'s).
    /// Only the parameters `which` includes are touched.
    fn update(&mut self, params: &[Tensor], hyper: &[Hyper], which: Which);
    /// Bytes of the state tensors it keeps.
    fn state_bytes(&self) -> u64;
    /// A short name ("Lion", "AdamW8bit", …).
    fn name(&self) -> &'static str;
}

/// Which parameters an update takes: every one that has a gradient, or one (the step in
/// backward updates each parameter as its gradient is ready).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    /// Every parameter with a gradient.
    All,
    /// Only the parameter of this index (if it has a gradient).
    Only(usize),
}

impl Which {
    /// Whether the parameter of `index` is taken.
    pub fn includes(self, index: usize) -> bool {
        match self {
            Which::All => true,
            Which::Only(only) => only == index,
        }
    }

    /// The items of a per-parameter iterator (parameters zipped with their state) that are
    /// taken, by position.
    pub fn pick<I: Iterator>(self, items: I) -> impl Iterator<Item = I::Item> {
        items
            .enumerate()
            .filter(move |(index, _)| self.includes(*index))
            .map(|(_, item)| item)
    }
}

/// The learning rate and weight decay a parameter is updated with: its group's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hyper {
    /// The learning rate.
    pub lr: f64,
    /// The weight decay set for the group (or all groups); `None`: the algorithm's configured one.
    pub wd: Option<f64>,
}

impl Hyper {
    /// The weight decay to apply: the group's, else `configured`.
    pub fn wd_or(&self, configured: f64) -> f64 {
        self.wd.unwrap_or(configured)
    }
}

/// An optimizer over a VarStore's trainable variables, with tch's `nn::Optimizer` methods.
pub struct Optimizer {
    variables: Arc<Mutex<nn::Variables>>,
    params: Vec<Tensor>,
    /// Each parameter's group (`nn::Path::set_group`), by index in `params`.
    groups: Vec<usize>,
    /// Learning rates set for one group (`set_lr_group`); others use `lr`.
    group_lr: BTreeMap<usize, f64>,
    /// Weight decay set for every group (`set_weight_decay`).
    wd: Option<f64>,
    /// Weight decay set for one group (`set_weight_decay_group`).
    group_wd: BTreeMap<usize, f64>,
    /// libtorch's own optimizer over the same parameters, never stepped (so it keeps no state):
    /// its `zero_grad` sets gradients to undefined, which tch offers no other way to do.
    grad_clearer: COptimizer,
    lr: f64,
    algorithm: Box<dyn Algorithm>,
}

impl std::fmt::Debug for Optimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Optimizer")
            .field("algorithm", &self.algorithm.name())
            .field("lr", &self.lr)
            .field("params", &self.params.len())
            .field("state_bytes", &self.algorithm.state_bytes())
            .finish()
    }
}

impl Optimizer {
    /// An optimizer for the trainable variables of `vs`; like tch's, it also picks up variables
    /// added to the store later, at the next `zero_grad`, `step` or clipping.
    pub fn new(
        vs: &nn::VarStore,
        lr: f64,
        algorithm: Box<dyn Algorithm>,
    ) -> Result<Optimizer, TchError> {
        let mut opt = Optimizer {
            variables: vs.variables_.clone(),
            params: Vec::new(),
            groups: Vec::new(),
            group_lr: BTreeMap::new(),
            wd: None,
            group_wd: BTreeMap::new(),
            grad_clearer: COptimizer::sgd(0.0, 0.0, 0.0, 0.0, false)?,
            lr,
            algorithm,
        };
        opt.add_missing_variables();
        Ok(opt)
    }

    fn add_missing_variables(&mut self) {
        let variables = crate::state::lock(&self.variables);
        let trainable = &variables.trainable_variables;
        for var in trainable.iter().skip(self.params.len()) {
            self.grad_clearer
                .add_parameters(&var.tensor, 0)
                .expect("adding a parameter to libtorch's optimizer");
            self.params.push(var.tensor.shallow_clone());
            self.groups.push(var.group);
        }
    }

    /// Drops the gradients (sets them to undefined, as tch's `nn::Optimizer::zero_grad` does),
    /// so that they take no memory until the next backward pass.
    pub fn zero_grad(&mut self) {
        self.add_missing_variables();
        self.grad_clearer
            .zero_grad()
            .expect("clearing gradients through libtorch's optimizer");
    }

    /// Applies one update.
    pub fn step(&mut self) {
        self.update(Which::All);
    }

    /// Updates the parameters `which` takes (each group's learning rate and weight decay).
    fn update(&mut self, which: Which) {
        self.add_missing_variables();
        let hyper: Vec<Hyper> = self
            .groups
            .iter()
            .map(|group| Hyper {
                lr: self.group_lr.get(group).copied().unwrap_or(self.lr),
                wd: self.group_wd.get(group).copied().or(self.wd),
            })
            .collect();
        self.algorithm.update(&self.params, &hyper, which);
    }

    /// The parameters, in the order of their indices (trainable variables as the store lists
    /// them, new ones picked up first).
    fn parameters(&mut self) -> &[Tensor] {
        self.add_missing_variables();
        &self.params
    }

    /// `zero_grad`, `loss.backward()`, `step`.
    pub fn backward_step(&mut self, loss: &Tensor) {
        self.zero_grad();
        loss.backward();
        self.step();
    }

    /// `zero_grad`, `loss.backward()`, [`clip_grad_value`](Self::clip_grad_value)`(max)`, `step`
    /// (as tch's method of this name: it clips values, not the norm).
    pub fn backward_step_clip(&mut self, loss: &Tensor, max: f64) {
        self.zero_grad();
        loss.backward();
        self.clip_grad_value(max);
        self.step();
    }

    /// `zero_grad`, `loss.backward()`, [`clip_grad_norm`](Self::clip_grad_norm)`(max)`, `step`.
    pub fn backward_step_clip_norm(&mut self, loss: &Tensor, max: f64) {
        self.zero_grad();
        loss.backward();
        self.clip_grad_norm(max);
        self.step();
    }

    /// Clamps every gradient element to `[-max, max]`.
    pub fn clip_grad_value(&mut self, max: f64) {
        self.add_missing_variables();
        tch::no_grad(|| {
            for p in &self.params {
                let mut grad = p.grad();
                if grad.defined() {
                    let _ = grad.clamp_(-max, max);
                }
            }
        })
    }

    /// Scales the gradients so that their global L2 norm (all of them as one vector) is at most
    /// `max`, as tch does; returns the norm before clipping (0 without gradients).
    pub fn clip_grad_norm(&mut self, max: f64) -> f64 {
        self.add_missing_variables();
        tch::no_grad(|| {
            let grads: Vec<Tensor> = self
                .params
                .iter()
                .map(Tensor::grad)
                .filter(Tensor::defined)
                .collect();
            let Some(first) = grads.first() else {
                return 0.0;
            };
            let device = first.device();
            let norms: Vec<Tensor> = grads
                .iter()
                .map(|g| g.norm().to_kind(Kind::Float).to_device(device))
                .collect();
            let total = f64::try_from(Tensor::stack(&norms, 0).norm()).unwrap_or(f64::NAN);
            let coef = max / (total + 1e-6);
            if coef < 1.0 {
                for mut g in grads {
                    let _ = g.g_mul_scalar_(coef);
                }
            }
            total
        })
    }

    /// Sets the learning rate of every group (as tch's does).
    pub fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
        self.group_lr.clear();
    }

    /// Sets the learning rate of the parameters of `group` (`nn::Path::set_group`).
    pub fn set_lr_group(&mut self, group: usize, lr: f64) {
        self.group_lr.insert(group, lr);
    }

    /// Sets the weight decay of every group, in place of the configured one.
    pub fn set_weight_decay(&mut self, wd: f64) {
        self.wd = Some(wd);
        self.group_wd.clear();
    }

    /// Sets the weight decay of the parameters of `group` (min-gpt's no-decay group for biases
    /// and norms: `opt.set_weight_decay_group(0, 0.0)`).
    pub fn set_weight_decay_group(&mut self, group: usize, wd: f64) {
        self.group_wd.insert(group, wd);
    }

    /// The learning rate.
    pub fn lr(&self) -> f64 {
        self.lr
    }

    /// Bytes of the optimizer's state (exact: the bytes of its state tensors).
    pub fn state_bytes(&self) -> u64 {
        self.algorithm.state_bytes()
    }

    /// The algorithm's name.
    pub fn name(&self) -> &'static str {
        self.algorithm.name()
    }
}

impl Step for Optimizer {
    fn step(&mut self) {
        Optimizer::step(self)
    }
    fn zero_grad(&mut self) {
        Optimizer::zero_grad(self)
    }
}

/// Grows per-parameter state to one slot per parameter (new parameters start without state).
fn grow<T>(state: &mut Vec<Option<T>>, params: usize) {
    if state.len() < params {
        state.resize_with(params, || None);
    }
}

/// The gradient of `p` as f32 (it may alias the gradient: never modify it in place), or `None`
/// when `p` has none.
fn grad_f32(p: &Tensor) -> Option<Tensor> {
    let g = p.grad();
    g.defined().then(|| g.to_kind(Kind::Float))
}

/// Decoupled weight decay: `p ← p·(1 − lr·wd)`.
fn decay(p: &mut Tensor, lr: f64, wd: f64) {
    if wd != 0.0 {
        let _ = p.g_mul_scalar_(1.0 - lr * wd);
    }
}

/// Zeros of `p`'s shape in f32 on its device (fresh, contiguous, no grad).
fn zeros_f32(p: &Tensor) -> Tensor {
    Tensor::zeros(p.size(), (Kind::Float, p.device()))
}

/// Total bytes (`numel × element size`) of some state tensors.
fn bytes<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> u64 {
    tensors.into_iter().map(crate::tensor_bytes).sum()
}

/// Checks that a config value lies in a range; the error names it.
fn check(ok: bool, what: &str) -> Result<(), TchError> {
    if ok {
        Ok(())
    } else {
        Err(TchError::Kind(format!("invalid optimizer config: {what}")))
    }
}
