//! The optimizer step in backward: each parameter is updated as soon as backward has finished its
//! gradient, and that gradient is freed at once, so the gradients of the whole model never live
//! at the same time (PyTorch's optimizer-in-backward, through the post-accumulate-grad hooks
//! that libtorch has in C++ too: csrc/step_in_backward.cpp).

use std::ffi::{c_char, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use tch::Tensor;
use torch_sys::C_tensor;

use super::{Optimizer, Step, Which};
use crate::ffi;

type StepOne = extern "C" fn(*mut c_void, usize, *mut c_char, usize) -> c_int;

extern "C" {
    fn tchmem_step_in_backward_add(
        param: *const C_tensor,
        data: *mut c_void,
        step: StepOne,
        index: usize,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tchmem_step_in_backward_remove(
        param: *const C_tensor,
        data: *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
}

/// What an [`InBackward`] shares with its hooks.
struct Stepping {
    optimizer: Mutex<Optimizer>,
    /// While set (inside [`InBackward::backward_step_clip`]), each gradient is clamped to
    /// `[-max, max]` before its step: clipping by value is per element, so it can be done one
    /// parameter at a time.
    clip_value: Mutex<Option<f64>>,
}

/// Called by autograd (on its thread) once parameter `index`'s gradient is complete.
extern "C" fn step_one(data: *mut c_void, index: usize, err: *mut c_char, err_len: usize) -> c_int {
    // SAFETY: `data` is the Stepping inside an InBackward's Arc, which removes its hooks before
    // the Arc can go.
    let stepping = unsafe { &*(data as *const Stepping) };
    match catch_unwind(AssertUnwindSafe(|| {
        let clip = *crate::state::lock(&stepping.clip_value);
        let mut optimizer = crate::state::lock(&stepping.optimizer);
        if let Some(max) = clip {
            let mut grad = optimizer.parameters()[index].grad();
            if grad.defined() {
                tch::no_grad(|| {
                    let _ = grad.clamp_(-max, max);
                });
            }
        }
        optimizer.update(Which::Only(index))
    })) {
        Ok(()) => 0,
        Err(panic) => {
            ffi::write_error(&ffi::panic_text(&*panic), err, err_len);
            -1
        }
    }
}

/// An [`Optimizer`] that steps inside backward: `loss.backward()` (or
/// [`backward_step`](Self::backward_step)) updates every parameter as its gradient is ready and
/// frees the gradient; [`step`](Self::step) and [`zero_grad`](Self::zero_grad) are then left with
/// nothing to do, so a loop written `loss.backward(); opt.step(); opt.zero_grad()` or
/// `opt.backward_step(&loss)` trains as before with one model's gradients less at the peak.
///
/// ```no_run
/// # use tch::{nn, Device};
/// let vs = nn::VarStore::new(Device::Cpu);
/// let mut opt = tchmem::optim::AdamW::default().build(&vs, 1e-3).unwrap().in_backward();
/// ```
///
/// What needs every gradient before any step cannot be done: clipping by the global norm, the
/// f16 grad scaler's check for inf/nan, accumulation over micro-batches (each backward steps).
/// Clipping by value can: [`backward_step_clip`](Self::backward_step_clip).
/// Parameters get one hook each; a later `InBackward` over the same parameters takes them over.
pub struct InBackward {
    stepping: Arc<Stepping>,
    /// The parameters seen so far, by index; `None` for one that does not require grad (a
    /// frozen embedding): it gets no gradient and no hook until it does.
    hooked: Vec<Option<Tensor>>,
}

impl std::fmt::Debug for InBackward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InBackward")
            .field("optimizer", &*self.optimizer())
            .field("hooked", &self.hooked.len())
            .finish()
    }
}

impl Optimizer {
    /// This optimizer, stepping each parameter inside backward (see [`InBackward`]).
    pub fn in_backward(self) -> InBackward {
        let mut in_backward = InBackward {
            stepping: Arc::new(Stepping {
                optimizer: Mutex::new(self),
                clip_value: Mutex::new(None),
            }),
            hooked: Vec::new(),
        };
        in_backward.hook_new_parameters();
        in_backward
    }
}

impl InBackward {
    fn data(&self) -> *mut c_void {
        Arc::as_ptr(&self.stepping) as *mut c_void
    }

    fn optimizer(&self) -> std::sync::MutexGuard<'_, Optimizer> {
        crate::state::lock(&self.stepping.optimizer)
    }

    /// Hooks the parameters added to the store since the last call, and those that have come
    /// to require grad (unfrozen).
    fn hook_new_parameters(&mut self) {
        let mut optimizer = self.optimizer();
        let params = optimizer.parameters();
        let waiting = self.hooked.iter().any(Option::is_none);
        if params.len() == self.hooked.len() && !waiting {
            return;
        }
        let params: Vec<Tensor> = params.iter().map(Tensor::shallow_clone).collect();
        drop(optimizer);
        self.hooked.resize_with(params.len(), || None);
        for (index, param) in params.into_iter().enumerate() {
            if self.hooked[index].is_some() || !param.requires_grad() {
                continue;
            }
            ffi::call(|err, len| unsafe {
                tchmem_step_in_backward_add(param.as_ptr(), self.data(), step_one, index, err, len)
            })
            .unwrap_or_else(|e| panic!("parameter {index} of the optimizer: {e}"));
            self.hooked[index] = Some(param);
        }
    }

    /// Drops any gradient left (one made outside backward), then `loss.backward()`, which
    /// updates each parameter as its gradient is complete.
    pub fn backward_step(&mut self, loss: &Tensor) {
        self.zero_grad();
        loss.backward();
    }

    /// As tch's `backward_step_clip`: each gradient clamped to `[-max, max]` before its step,
    /// here inside backward, one parameter at a time (clipping by value is per element; by the
    /// global norm it would need every gradient first, so that one has no counterpart).
    pub fn backward_step_clip(&mut self, loss: &Tensor, max: f64) {
        struct Unset<'a>(&'a Mutex<Option<f64>>);
        impl Drop for Unset<'_> {
            fn drop(&mut self) {
                *crate::state::lock(self.0) = None;
            }
        }
        self.zero_grad();
        *crate::state::lock(&self.stepping.clip_value) = Some(max);
        let _unset = Unset(&self.stepping.clip_value);
        loss.backward();
    }

    /// Updates the parameters that still have a gradient (none after a backward pass: their
    /// steps were taken in it).
    pub fn step(&mut self) {
        self.hook_new_parameters();
        self.optimizer().step();
    }

    /// Drops any gradient left.
    pub fn zero_grad(&mut self) {
        self.hook_new_parameters();
        self.optimizer().zero_grad();
    }

    /// Sets the learning rate of every group.
    pub fn set_lr(&mut self, lr: f64) {
        self.optimizer().set_lr(lr);
    }

    /// Sets the learning rate of the parameters of `group`.
    pub fn set_lr_group(&mut self, group: usize, lr: f64) {
        self.optimizer().set_lr_group(group, lr);
    }

    /// Sets the weight decay of every group.
    pub fn set_weight_decay(&mut self, wd: f64) {
        self.optimizer().set_weight_decay(wd);
    }

    /// Sets the weight decay of the parameters of `group`.
    pub fn set_weight_decay_group(&mut self, group: usize, wd: f64) {
        self.optimizer().set_weight_decay_group(group, wd);
    }

    /// The learning rate.
    pub fn lr(&self) -> f64 {
        self.optimizer().lr()
    }

    /// Bytes of the optimizer's state.
    pub fn state_bytes(&self) -> u64 {
        self.optimizer().state_bytes()
    }

    /// The algorithm's name.
    pub fn name(&self) -> &'static str {
        self.optimizer().name()
    }
}

impl Step for InBackward {
    fn step(&mut self) {
        InBackward::step(self)
    }
    fn zero_grad(&mut self) {
        InBackward::zero_grad(self)
    }
}

impl Drop for InBackward {
    fn drop(&mut self) {
        for param in self.hooked.iter().flatten() {
            // Only this optimizer's own hooks: a newer one may have taken a parameter over.
            let _ = ffi::call(|err, len| unsafe {
                tchmem_step_in_backward_remove(param.as_ptr(), self.data(), err, len)
            });
        }
    }
}
