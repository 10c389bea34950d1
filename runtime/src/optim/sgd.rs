//! Stochastic gradient descent with momentum, as `torch.optim.SGD`.

use tch::{nn, TchError, Tensor};

use super::{bytes, check, grad_f32, grow, Algorithm, Hyper, Optimizer, Which};

/// SGD with (optionally Nesterov) momentum and L2 weight decay, with PyTorch's semantics.
///
/// State: one f32 momentum buffer per parameter (4 bytes per element), created at the
/// parameter's first step; none when `momentum` is 0.
///
/// ```no_run
/// # use tch::{nn, Device};
/// let vs = nn::VarStore::new(Device::Cpu);
/// let mut opt = tchmem::optim::Sgd { nesterov: true, ..Default::default() }
///     .build(&vs, 1e-2)
///     .unwrap();
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sgd {
    /// Momentum factor (0 disables the buffer).
    pub momentum: f64,
    /// Dampening of the gradient added to the momentum buffer.
    pub dampening: f64,
    /// L2 penalty added to the gradient (not decoupled).
    pub wd: f64,
    /// Nesterov momentum (needs `momentum > 0` and `dampening == 0`).
    pub nesterov: bool,
}

impl Default for Sgd {
    fn default() -> Self {
        Sgd {
            momentum: 0.9,
            dampening: 0.0,
            wd: 0.0,
            nesterov: false,
        }
    }
}

/// The same settings as tch's config (tch's default has no momentum; ours has 0.9): what
/// `%%optimize --step-in-backward` uses to carry them over.
impl From<nn::Sgd> for Sgd {
    fn from(c: nn::Sgd) -> Sgd {
        Sgd {
            momentum: c.momentum,
            dampening: c.dampening,
            wd: c.wd,
            nesterov: c.nesterov,
        }
    }
}

impl Sgd {
    /// An optimizer over `vs`'s trainable variables at learning rate `lr`.
    pub fn build(self, vs: &nn::VarStore, lr: f64) -> Result<Optimizer, TchError> {
        check(self.momentum >= 0.0, "Sgd momentum must be >= 0")?;
        check(self.wd >= 0.0, "Sgd wd must be >= 0")?;
        check(
            !self.nesterov || (self.momentum > 0.0 && self.dampening == 0.0),
            "Sgd nesterov needs momentum > 0 and dampening 0",
        )?;
        Optimizer::new(
            vs,
            lr,
            Box::new(SgdState {
                config: self,
                buffers: Vec::new(),
            }),
        )
    }
}

struct SgdState {
    config: Sgd,
    buffers: Vec<Option<Tensor>>,
}

impl Algorithm for SgdState {
    fn update(&mut self, params: &[Tensor], hyper: &[Hyper], which: Which) {
        let Sgd {
            momentum,
            dampening,
            wd,
            nesterov,
        } = self.config;
        grow(&mut self.buffers, params.len());
        tch::no_grad(|| {
            for ((p, buffer), h) in which.pick(params.iter().zip(&mut self.buffers).zip(hyper)) {
                let Some(g) = grad_f32(p) else { continue };
                let (lr, wd) = (h.lr, h.wd_or(wd));
                let mut d = if wd != 0.0 {
                    g + p.to_kind(tch::Kind::Float) * wd
                } else {
                    g
                };
                if momentum != 0.0 {
                    let buf = match buffer {
                        Some(buf) => {
                            let _ = buf.g_mul_scalar_(momentum);
                            let _ = buf.g_add_(&(&d * (1.0 - dampening)));
                            buf
                        }
                        None => buffer.insert(d.detach().copy()),
                    };
                    d = if nesterov {
                        d + &*buf * momentum
                    } else {
                        buf.shallow_clone()
                    };
                }
                let _ = p.shallow_clone().g_add_(&(d * -lr));
            }
        })
    }

    fn state_bytes(&self) -> u64 {
        bytes(self.buffers.iter().flatten())
    }

    fn name(&self) -> &'static str {
        "Sgd"
    }
}
