//! Adam and AdamW on torch's fused kernels: the same update as tch's `nn::Adam` / `nn::AdamW`
//! (libtorch's C++ optimizers), in one kernel per device and dtype for all parameters where
//! those launch several kernels per parameter. On a step of tens of milliseconds (mixed
//! precision on a GPU) the difference is several percent of the step time.

use std::collections::BTreeMap;
use std::ffi::{c_char, c_int};

use tch::{nn, Kind, TchError, Tensor};
use torch_sys::C_tensor;

use super::{bytes, check, grow, Algorithm, Hyper, Optimizer, Which};
use crate::ffi;

extern "C" {
    fn tchmem_fused_adam(
        params: *const *mut C_tensor,
        exp_avgs: *const *mut C_tensor,
        exp_avg_sqs: *const *mut C_tensor,
        max_exp_avg_sqs: *const *mut C_tensor,
        steps: *const *mut C_tensor,
        n: usize,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        amsgrad: c_int,
        decoupled: c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
}

/// Adam with an L2 penalty added to the gradient, as tch's `nn::Adam` (same defaults).
///
/// State: two moments per parameter in the parameter's kind (8 bytes per f32 element; 12 with
/// `amsgrad`) and a 4-byte step count, created at the parameter's first step.
///
/// ```no_run
/// # use tch::{nn, Device};
/// let vs = nn::VarStore::new(Device::Cpu);
/// let mut opt = tchmem::optim::Adam::default().build(&vs, 1e-3).unwrap();
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Adam {
    /// Decay of the first moment.
    pub beta1: f64,
    /// Decay of the second moment.
    pub beta2: f64,
    /// L2 penalty.
    pub wd: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Keep the running maximum of the second moment.
    pub amsgrad: bool,
}

impl Default for Adam {
    fn default() -> Self {
        Adam {
            beta1: 0.9,
            beta2: 0.999,
            wd: 0.0,
            eps: 1e-8,
            amsgrad: false,
        }
    }
}

/// AdamW: Adam with decoupled weight decay, as tch's `nn::AdamW` (same defaults, `wd` 0.01).
///
/// ```no_run
/// # use tch::{nn, Device};
/// let vs = nn::VarStore::new(Device::Cpu);
/// let mut opt = tchmem::optim::AdamW::default().build(&vs, 3e-4).unwrap();
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW {
    /// Decay of the first moment.
    pub beta1: f64,
    /// Decay of the second moment.
    pub beta2: f64,
    /// Decoupled weight decay: `p ← p·(1 − lr·wd)`.
    pub wd: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Keep the running maximum of the second moment.
    pub amsgrad: bool,
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW {
            wd: 0.01,
            ..Adam::default().into_adamw()
        }
    }
}

/// The same settings as tch's config (what `%%optimize --amp` uses to carry them over).
impl From<nn::Adam> for Adam {
    fn from(c: nn::Adam) -> Adam {
        Adam {
            beta1: c.beta1,
            beta2: c.beta2,
            wd: c.wd,
            eps: c.eps,
            amsgrad: c.amsgrad,
        }
    }
}

/// The same settings as tch's config (what `%%optimize --amp` uses to carry them over).
impl From<nn::AdamW> for AdamW {
    fn from(c: nn::AdamW) -> AdamW {
        AdamW {
            beta1: c.beta1,
            beta2: c.beta2,
            wd: c.wd,
            eps: c.eps,
            amsgrad: c.amsgrad,
        }
    }
}

impl Adam {
    fn into_adamw(self) -> AdamW {
        let Adam {
            beta1,
            beta2,
            wd,
            eps,
            amsgrad,
        } = self;
        AdamW {
            beta1,
            beta2,
            wd,
            eps,
            amsgrad,
        }
    }

    /// An optimizer over `vs`'s trainable variables at learning rate `lr`.
    pub fn build(self, vs: &nn::VarStore, lr: f64) -> Result<Optimizer, TchError> {
        FusedAdam::build(self.into_adamw(), false, vs, lr)
    }
}

impl AdamW {
    /// An optimizer over `vs`'s trainable variables at learning rate `lr`.
    pub fn build(self, vs: &nn::VarStore, lr: f64) -> Result<Optimizer, TchError> {
        FusedAdam::build(self, true, vs, lr)
    }
}

/// One parameter's state.
struct Moments {
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    max_exp_avg_sq: Option<Tensor>,
    /// Its step count: an f32 scalar on the parameter's device, as the fused kernels read it,
    /// viewed into a buffer shared with the parameters that started at the same step.
    step: Tensor,
}

struct FusedAdam {
    config: AdamW,
    decoupled: bool,
    state: Vec<Option<Moments>>,
    /// The buffers the step counts live in: one small allocation for a whole model instead of
    /// one 512-byte block per parameter.
    step_buffers: Vec<Tensor>,
}

impl FusedAdam {
    fn build(
        config: AdamW,
        decoupled: bool,
        vs: &nn::VarStore,
        lr: f64,
    ) -> Result<Optimizer, TchError> {
        let name = if decoupled { "AdamW" } else { "Adam" };
        check(
            (0.0..1.0).contains(&config.beta1) && (0.0..1.0).contains(&config.beta2),
            &format!("{name} betas must lie in [0, 1)"),
        )?;
        check(config.eps >= 0.0, &format!("{name} eps must be >= 0"))?;
        check(config.wd >= 0.0, &format!("{name} wd must be >= 0"))?;
        Optimizer::new(
            vs,
            lr,
            Box::new(FusedAdam {
                config,
                decoupled,
                state: Vec::new(),
                step_buffers: Vec::new(),
            }),
        )
    }
}

impl FusedAdam {
    /// Gives the parameters about to take their first step (they have a gradient and no state)
    /// zero moments, and step counts in one new buffer per device.
    fn start_new_parameters(&mut self, params: &[Tensor], which: Which) {
        let new: Vec<usize> = (0..params.len())
            .filter(|&i| which.includes(i) && self.state[i].is_none() && params[i].grad().defined())
            .collect();
        let mut devices: Vec<tch::Device> = Vec::new();
        for &i in &new {
            if !devices.contains(&params[i].device()) {
                devices.push(params[i].device());
            }
        }
        for device in devices {
            let here: Vec<usize> = new
                .iter()
                .copied()
                .filter(|&i| params[i].device() == device)
                .collect();
            let buffer = Tensor::zeros([here.len() as i64], (Kind::Float, device));
            for (slot, &i) in here.iter().enumerate() {
                let p = &params[i];
                let zeros = || tch::no_grad(|| p.zeros_like());
                self.state[i] = Some(Moments {
                    exp_avg: zeros(),
                    exp_avg_sq: zeros(),
                    max_exp_avg_sq: self.config.amsgrad.then(zeros),
                    step: buffer.select(0, slot as i64),
                });
            }
            self.step_buffers.push(buffer);
        }
    }
}

/// The lists of one fused call: parameters of one learning rate and weight decay.
#[derive(Default)]
struct FusedCall {
    lr: f64,
    wd: f64,
    /// The parameters the pointers in `params` point to, alive through the call.
    kept: Vec<Tensor>,
    params: Vec<*mut C_tensor>,
    exp_avgs: Vec<*mut C_tensor>,
    exp_avg_sqs: Vec<*mut C_tensor>,
    max_exp_avg_sqs: Vec<*mut C_tensor>,
    steps: Vec<*mut C_tensor>,
}

impl Algorithm for FusedAdam {
    fn update(&mut self, params: &[Tensor], hyper: &[Hyper], which: Which) {
        grow(&mut self.state, params.len());
        self.start_new_parameters(params, which);
        let AdamW {
            beta1,
            beta2,
            wd,
            eps,
            amsgrad,
        } = self.config;
        // One fused call per learning rate and weight decay (one for all without groups).
        let mut calls: BTreeMap<(u64, u64), FusedCall> = BTreeMap::new();
        for ((p, state), h) in which.pick(params.iter().zip(&mut self.state).zip(hyper)) {
            let Some(moments) = state.as_mut().filter(|_| p.grad().defined()) else {
                continue;
            };
            let (lr, wd) = (h.lr, h.wd_or(wd));
            let call = calls
                .entry((lr.to_bits(), wd.to_bits()))
                .or_insert_with(|| FusedCall {
                    lr,
                    wd,
                    ..Default::default()
                });
            let mut p = p.shallow_clone();
            call.params.push(p.as_mut_ptr());
            call.kept.push(p);
            call.exp_avgs.push(moments.exp_avg.as_mut_ptr());
            call.exp_avg_sqs.push(moments.exp_avg_sq.as_mut_ptr());
            if let Some(max) = &mut moments.max_exp_avg_sq {
                call.max_exp_avg_sqs.push(max.as_mut_ptr());
            }
            call.steps.push(moments.step.as_mut_ptr());
        }
        for call in calls.values() {
            ffi::call(|err, len| unsafe {
                tchmem_fused_adam(
                    call.params.as_ptr(),
                    call.exp_avgs.as_ptr(),
                    call.exp_avg_sqs.as_ptr(),
                    call.max_exp_avg_sqs.as_ptr(),
                    call.steps.as_ptr(),
                    call.params.len(),
                    call.lr,
                    beta1,
                    beta2,
                    call.wd,
                    eps,
                    amsgrad as c_int,
                    self.decoupled as c_int,
                    err,
                    len,
                )
            })
            .unwrap_or_else(|e| panic!("{} step: {e}", self.name()));
        }
    }

    fn state_bytes(&self) -> u64 {
        let moments = self.state.iter().flatten().flat_map(|m| {
            [
                Some(&m.exp_avg),
                Some(&m.exp_avg_sq),
                m.max_exp_avg_sq.as_ref(),
            ]
            .into_iter()
            .flatten()
        });
        bytes(moments.chain(&self.step_buffers))
    }

    fn name(&self) -> &'static str {
        if self.decoupled {
            "AdamW"
        } else {
            "Adam"
        }
    }
}
