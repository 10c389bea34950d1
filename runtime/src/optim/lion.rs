//! Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

use tch::{nn, Kind, TchError, Tensor};

use super::{bytes, check, decay, grad_f32, grow, Algorithm, Hyper, Optimizer, Which};

/// Lion: the update is the sign of an interpolation of momentum and gradient, so every element
/// moves by exactly `lr`; weight decay is decoupled.
///
/// Per step: `u = sign(β1·m + (1−β1)·g)`, `p ← p·(1 − lr·wd) − lr·u`,
/// `m ← β2·m + (1−β2)·g`.
///
/// State: one momentum buffer per parameter in the parameter's own kind (half the memory of
/// Adam's two f32 moments for f32 parameters), created at the parameter's first step.
///
/// ```no_run
/// # use tch::{nn, Device};
/// let vs = nn::VarStore::new(Device::Cpu);
/// let mut opt = tchmem::optim::Lion { wd: 0.1, ..Default::default() }.build(&vs, 1e-4).unwrap();
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Lion {
    /// Interpolation factor of the update direction.
    pub beta1: f64,
    /// Decay of the momentum buffer.
    pub beta2: f64,
    /// Decoupled weight decay.
    pub wd: f64,
}

impl Default for Lion {
    fn default() -> Self {
        Lion {
            beta1: 0.9,
            beta2: 0.99,
            wd: 0.0,
        }
    }
}

impl Lion {
    /// An optimizer over `vs`'s trainable variables at learning rate `lr`.
    pub fn build(self, vs: &nn::VarStore, lr: f64) -> Result<Optimizer, TchError> {
        check(
            (0.0..=1.0).contains(&self.beta1),
            "Lion beta1 must be in [0, 1]",
        )?;
        check(
            (0.0..=1.0).contains(&self.beta2),
            "Lion beta2 must be in [0, 1]",
        )?;
        check(self.wd >= 0.0, "Lion wd must be >= 0")?;
        Optimizer::new(
            vs,
            lr,
            Box::new(LionState {
                config: self,
                momenta: Vec::new(),
            }),
        )
    }
}

struct LionState {
    config: Lion,
    momenta: Vec<Option<Tensor>>,
}

impl Algorithm for LionState {
    fn update(&mut self, params: &[Tensor], hyper: &[Hyper], which: Which) {
        let Lion { beta1, beta2, wd } = self.config;
        grow(&mut self.momenta, params.len());
        tch::no_grad(|| {
            for ((p, momentum), h) in which.pick(params.iter().zip(&mut self.momenta).zip(hyper)) {
                let Some(g) = grad_f32(p) else { continue };
                let (lr, wd) = (h.lr, h.wd_or(wd));
                let m = momentum.get_or_insert_with(|| p.zeros_like());
                let direction = (m.to_kind(Kind::Float) * beta1 + &g * (1.0 - beta1)).sign();
                let mut p = p.shallow_clone();
                decay(&mut p, lr, wd);
                let _ = p.g_add_(&(direction * -lr));
                let _ = m.lerp_(&g.to_kind(m.kind()), 1.0 - beta2);
            }
        })
    }

    fn state_bytes(&self) -> u64 {
        bytes(self.momenta.iter().flatten())
    }

    fn name(&self) -> &'static str {
        "Lion"
    }
}
