//! Adafactor (Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates with Sublinear Memory
//! Cost"), with the semantics of Hugging Face's `transformers.optimization.Adafactor`.

use tch::{nn, Kind, TchError, Tensor};

use super::{bytes, check, decay, grad_f32, grow, zeros_f32, Algorithm, Hyper, Optimizer, Which};

/// Adafactor: Adam-like scaling whose second moment of a matrix is kept as its row and column
/// means (rank-1 factored), so it costs `rows + cols` instead of `rows × cols`.
///
/// Per step `t` of a parameter: `β2t = 1 − t^decay_rate`; the second moment accumulates
/// `g² + eps1` (factored over the last two dims for tensors of two dims or more, whole for
/// 1-D); the update `g / sqrt(v̂)` is divided by `max(1, RMS(update) / clip_threshold)`, scaled
/// by the step size, averaged with `beta1` if set, and subtracted; weight decay is decoupled
/// (`p ← p − wd·step_size·p`).
///
/// The step size is the optimizer's `lr`, or with `relative_step` `min(1e-2, 1/sqrt(t))`
/// (ignoring `lr`); with `scale_parameter` it is multiplied by `max(eps2, RMS(p))`.
///
/// State (f32, created at a parameter's first step): for a tensor of shape `[…, r, c]`, a row
/// accumulator of `prod(…)·r` and a column one of `prod(…)·c` elements; for 1-D (and 0-D)
/// tensors a full one; plus a full first moment if `beta1` is set. The step count is a plain
/// integer, not a tensor.
///
/// ```no_run
/// # use tch::{nn, Device};
/// let vs = nn::VarStore::new(Device::Cpu);
/// let mut opt = tchmem::optim::Adafactor::default().build(&vs, 1e-2).unwrap();
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Adafactor {
    /// Added to the squared gradient (regularizes the second moment).
    pub eps1: f64,
    /// Lower bound of the parameter scale (with `scale_parameter`).
    pub eps2: f64,
    /// Threshold of the RMS of the unscaled update.
    pub clip_threshold: f64,
    /// Exponent of the second moment's decay schedule `β2t = 1 − t^decay_rate`.
    pub decay_rate: f64,
    /// First-moment decay; `None` keeps no first moment (the memory-saving default).
    pub beta1: Option<f64>,
    /// Decoupled weight decay.
    pub wd: f64,
    /// Use the time-dependent step size `min(1e-2, 1/sqrt(t))` instead of `lr`.
    pub relative_step: bool,
    /// Multiply the step size by the parameter's RMS (at least `eps2`).
    pub scale_parameter: bool,
}

impl Default for Adafactor {
    fn default() -> Self {
        Adafactor {
            eps1: 1e-30,
            eps2: 1e-3,
            clip_threshold: 1.0,
            decay_rate: -0.8,
            beta1: None,
            wd: 0.0,
            relative_step: false,
            scale_parameter: false,
        }
    }
}

impl Adafactor {
    /// An optimizer over `vs`'s trainable variables at learning rate `lr`.
    pub fn build(self, vs: &nn::VarStore, lr: f64) -> Result<Optimizer, TchError> {
        check(
            self.eps1 >= 0.0 && self.eps2 >= 0.0,
            "Adafactor eps1, eps2 must be >= 0",
        )?;
        check(
            self.clip_threshold > 0.0,
            "Adafactor clip_threshold must be > 0",
        )?;
        check(self.decay_rate < 0.0, "Adafactor decay_rate must be < 0")?;
        check(
            self.beta1.is_none_or(|b| (0.0..1.0).contains(&b)),
            "Adafactor beta1 must be in [0, 1)",
        )?;
        check(self.wd >= 0.0, "Adafactor wd must be >= 0")?;
        Optimizer::new(
            vs,
            lr,
            Box::new(AdafactorState {
                config: self,
                params: Vec::new(),
            }),
        )
    }
}

/// One parameter's second moment.
enum SecondMoment {
    /// Row and column means of `g² + eps1` over the last two dims.
    Factored { row: Tensor, col: Tensor },
    /// The whole `g² + eps1` average (1-D and 0-D parameters).
    Full(Tensor),
}

struct ParamState {
    step: i32,
    second: SecondMoment,
    first: Option<Tensor>,
}

struct AdafactorState {
    config: Adafactor,
    params: Vec<Option<ParamState>>,
}

/// Root mean square of all elements (a 0-D tensor).
fn rms(x: &Tensor) -> Tensor {
    x.square().mean(Kind::Float).sqrt()
}

impl Algorithm for AdafactorState {
    fn update(&mut self, params: &[Tensor], hyper: &[Hyper], which: Which) {
        let c = self.config;
        grow(&mut self.params, params.len());
        tch::no_grad(|| {
            for ((p, state), h) in which.pick(params.iter().zip(&mut self.params).zip(hyper)) {
                let Some(g) = grad_f32(p) else { continue };
                let lr = h.lr;
                let state = state.get_or_insert_with(|| {
                    let shape = p.size();
                    let second = if shape.len() >= 2 {
                        let (r, c) = (shape.len() - 1, shape.len() - 2);
                        let device = p.device();
                        let row = Tensor::zeros(&shape[..r], (Kind::Float, device));
                        let mut col_shape = shape[..c].to_vec();
                        col_shape.push(shape[r]);
                        let col = Tensor::zeros(col_shape.as_slice(), (Kind::Float, device));
                        SecondMoment::Factored { row, col }
                    } else {
                        SecondMoment::Full(zeros_f32(p))
                    };
                    let first = c.beta1.map(|_| zeros_f32(p));
                    ParamState {
                        step: 0,
                        second,
                        first,
                    }
                });
                state.step += 1;
                let t = f64::from(state.step);
                let mut step_size = if c.relative_step {
                    (1.0 / t.sqrt()).min(1e-2)
                } else {
                    lr
                };
                if c.scale_parameter {
                    let scale = f64::try_from(rms(p)).unwrap_or(0.0);
                    step_size *= scale.max(c.eps2);
                }
                let beta2t = 1.0 - t.powf(c.decay_rate);
                let squared = g.square() + c.eps1;
                let update = match &mut state.second {
                    SecondMoment::Factored { row, col } => {
                        let _ = row.lerp_(&squared.mean_dim(-1, false, Kind::Float), 1.0 - beta2t);
                        let _ = col.lerp_(&squared.mean_dim(-2, false, Kind::Float), 1.0 - beta2t);
                        // v̂ = row·colᵀ / mean(row): its inverse square root, times g.
                        let row_factor = (&*row / row.mean_dim(-1, true, Kind::Float))
                            .rsqrt()
                            .unsqueeze(-1);
                        let col_factor = col.unsqueeze(-2).rsqrt();
                        row_factor * col_factor * &g
                    }
                    SecondMoment::Full(v) => {
                        let _ = v.lerp_(&squared, 1.0 - beta2t);
                        v.rsqrt() * &g
                    }
                };
                drop(squared);
                let clip = (rms(&update) / c.clip_threshold).clamp_min(1.0);
                let mut update = update / clip * step_size;
                if let (Some(beta1), Some(m)) = (c.beta1, state.first.as_mut()) {
                    let _ = m.lerp_(&update, 1.0 - beta1);
                    update = m.shallow_clone();
                }
                let mut p = p.shallow_clone();
                decay(&mut p, step_size, h.wd_or(c.wd));
                let _ = p.g_sub_(&update);
            }
        })
    }

    fn state_bytes(&self) -> u64 {
        self.params
            .iter()
            .flatten()
            .map(|state| {
                let second = match &state.second {
                    SecondMoment::Factored { row, col } => bytes([row, col]),
                    SecondMoment::Full(v) => bytes([v]),
                };
                second + bytes(&state.first)
            })
            .sum()
    }

    fn name(&self) -> &'static str {
        "Adafactor"
    }
}
