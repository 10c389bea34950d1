//! AdamW with both moments stored in 8 bits, block-wise quantized (Dettmers et al. 2022,
//! "8-bit Optimizers via Block-wise Quantization", as bitsandbytes' `AdamW8bit`).

use tch::{nn, Device, Kind, TchError, Tensor};

use super::{bytes, check, decay, grad_f32, grow, zeros_f32, Algorithm, Hyper, Optimizer, Which};

/// Elements processed at once per parameter, so that the f32 temporaries of a step stay small
/// next to the 8-bit state of a large parameter (rounded to whole blocks).
const CHUNK: usize = 1 << 22;

/// Entries of a quantization map (one per 8-bit code).
const CODES: usize = 256;

/// AdamW (decoupled weight decay, bias-corrected moments) whose moments take 1 byte per element
/// each instead of 4.
///
/// Each step dequantizes a parameter's moments to f32, updates them and the parameter with the
/// fresh values, and requantizes them:
///
/// - **Blocks.** Every `block_size` consecutive elements share one f32 scale, their absolute
///   maximum, so an outlier only costs precision within its own block.
/// - **Map.** The 8-bit codes index bitsandbytes' *dynamic* (tree) quantization map rather than
///   a linear one: 7 decades of exponent with more fraction steps for larger values, giving a
///   roughly constant relative error over `[1e-6, 1]` of the block maximum, where a linear map
///   would round everything below `1/254` of it to zero. The first moment uses the signed map,
///   values are rounded to the nearest code.
/// - **Second moment.** `sqrt(v)` is stored (with the unsigned map, all 256 codes for
///   non-negative values) instead of `v`: the square root halves the dynamic range in decades,
///   so small second moments do not round to zero (which would turn `m / (sqrt(v) + eps)` into
///   `m / eps`), and the update needs `sqrt(v)` anyway.
///
/// Parameters with fewer than `min_8bit_size` elements (biases, norms) keep plain f32 moments,
/// as bitsandbytes does: their state is small and quantizing it saves little.
///
/// State, exactly: per quantized parameter of `n` elements `2n` bytes of codes plus
/// `2 × 4 × ceil(n / block_size)` bytes of scales; per small parameter `8n` bytes; plus 4088
/// bytes of lookup tables (both maps and their midpoints) per device that holds a quantized
/// parameter. For large models that is ≈ 2 bytes per element, a quarter of fp32 AdamW's 8. The
/// step count of each parameter is a plain integer, not a tensor. State is created at a
/// parameter's first step.
///
/// ```no_run
/// # use tch::{nn, Device};
/// let vs = nn::VarStore::new(Device::Cuda(0));
/// let mut opt = tchmem::optim::AdamW8bit::default().build(&vs, 1e-3).unwrap();
/// println!("{} bytes of state", opt.state_bytes());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW8bit {
    /// Decay of the first moment.
    pub beta1: f64,
    /// Decay of the second moment.
    pub beta2: f64,
    /// Added to `sqrt(v̂)` in the denominator.
    pub eps: f64,
    /// Decoupled weight decay.
    pub wd: f64,
    /// Elements per quantization block (one f32 scale per block and moment).
    pub block_size: usize,
    /// Parameters with fewer elements keep f32 moments.
    pub min_8bit_size: usize,
}

impl Default for AdamW8bit {
    fn default() -> Self {
        AdamW8bit {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            wd: 0.01,
            block_size: 256,
            min_8bit_size: 4096,
        }
    }
}

impl AdamW8bit {
    /// An optimizer over `vs`'s trainable variables at learning rate `lr`.
    pub fn build(self, vs: &nn::VarStore, lr: f64) -> Result<Optimizer, TchError> {
        check(
            (0.0..1.0).contains(&self.beta1),
            "AdamW8bit beta1 must be in [0, 1)",
        )?;
        check(
            (0.0..1.0).contains(&self.beta2),
            "AdamW8bit beta2 must be in [0, 1)",
        )?;
        check(self.eps >= 0.0, "AdamW8bit eps must be >= 0")?;
        check(self.wd >= 0.0, "AdamW8bit wd must be >= 0")?;
        check(self.block_size > 0, "AdamW8bit block_size must be > 0")?;
        let state = AdamW8bitState {
            config: self,
            params: Vec::new(),
            maps: Vec::new(),
        };
        Optimizer::new(vs, lr, Box::new(state))
    }
}

/// One parameter's moments.
enum Moments {
    /// f32 `m` and `v` (small parameters).
    Full { m: Tensor, v: Tensor },
    /// uint8 codes of `m` (signed map) and of `sqrt(v)` (unsigned map), with per-block scales.
    Quantized {
        m: Tensor,
        m_scale: Tensor,
        s: Tensor,
        s_scale: Tensor,
    },
}

struct ParamState {
    step: i32,
    moments: Moments,
}

/// The quantization maps (sorted code values) and the midpoints between neighbouring codes, on
/// one device.
struct Maps {
    device: Device,
    signed: Tensor,
    signed_mid: Tensor,
    unsigned: Tensor,
    unsigned_mid: Tensor,
}

impl Maps {
    fn new(device: Device) -> Maps {
        let tensors = |signed: bool| {
            let map = dynamic_map(signed);
            let mid: Vec<f32> = map.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect();
            (
                Tensor::from_slice(&map).to_device(device),
                Tensor::from_slice(&mid).to_device(device),
            )
        };
        let (signed, signed_mid) = tensors(true);
        let (unsigned, unsigned_mid) = tensors(false);
        Maps {
            device,
            signed,
            signed_mid,
            unsigned,
            unsigned_mid,
        }
    }
}

/// bitsandbytes' `create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)`: for each
/// decade `10^(i−6)`, `i` in 0..7, the midpoints of `2^i` (signed, ± each) or `2^(i+1)`
/// (unsigned) equal steps of `[0.1, 1]`, plus 0 and 1; sorted, 256 values.
fn dynamic_map(signed: bool) -> Vec<f32> {
    let mut data = Vec::with_capacity(CODES);
    for i in 0..7 {
        let steps = if signed {
            1usize << i
        } else {
            1usize << (i + 1)
        };
        let decade = 10f64.powi(i - 6);
        for k in 0..steps {
            let width = 0.9 / steps as f64;
            let mean = 0.1 + width * (k as f64 + 0.5);
            data.push((decade * mean) as f32);
            if signed {
                data.push((-decade * mean) as f32);
            }
        }
    }
    data.push(0.0);
    data.push(1.0);
    debug_assert_eq!(data.len(), CODES);
    data.sort_by(f32::total_cmp);
    data
}

/// `x` (f32, 1-D) padded with zeros to `blocks × block` and viewed as `[blocks, block]`.
fn as_blocks(x: &Tensor, block: usize) -> Tensor {
    let len = x.size()[0] as usize;
    let blocks = len.div_ceil(block);
    let pad = blocks * block - len;
    let x = if pad > 0 {
        x.constant_pad_nd([0, pad as i64])
    } else {
        x.shallow_clone()
    };
    x.view([blocks as i64, block as i64])
}

/// Values of the codes `q` (uint8, 1-D) under `map`, times their blocks' `scale`s.
fn dequantize(q: &Tensor, scale: &Tensor, map: &Tensor, block: usize) -> Tensor {
    let len = q.size()[0];
    let values = map.index_select(0, &q.to_kind(Kind::Int));
    (as_blocks(&values, block) * scale.unsqueeze(1))
        .view([-1])
        .narrow(0, 0, len)
}

/// Writes into `q` the nearest codes of `x` (f32, 1-D) divided by its blocks' absolute maxima,
/// and those maxima into `scale`.
fn quantize(x: &Tensor, q: &mut Tensor, scale: &mut Tensor, mid: &Tensor, block: usize) {
    let len = x.size()[0];
    let blocks = as_blocks(x, block);
    let absmax = blocks.abs().amax([1], true);
    let normalized = (blocks / absmax.clamp_min(f64::from(f32::MIN_POSITIVE)))
        .view([-1])
        .narrow(0, 0, len);
    // Codes whose lower midpoint is below the value: the index of the nearest code.
    q.copy_(&normalized.bucketize(mid, true, false));
    scale.copy_(&absmax.view([-1]));
}

struct AdamW8bitState {
    config: AdamW8bit,
    params: Vec<Option<ParamState>>,
    maps: Vec<Maps>,
}

impl AdamW8bitState {
    fn maps(&mut self, device: Device) -> usize {
        match self.maps.iter().position(|m| m.device == device) {
            Some(i) => i,
            None => {
                self.maps.push(Maps::new(device));
                self.maps.len() - 1
            }
        }
    }
}

impl Algorithm for AdamW8bitState {
    fn update(&mut self, params: &[Tensor], hyper: &[Hyper], which: Which) {
        let AdamW8bit {
            beta1,
            beta2,
            eps,
            wd,
            block_size,
            min_8bit_size,
        } = self.config;
        grow(&mut self.params, params.len());
        tch::no_grad(|| {
            for (i, p) in which.pick(params.iter().enumerate()) {
                let Some(g) = grad_f32(p) else { continue };
                let (lr, wd) = (hyper[i].lr, hyper[i].wd_or(wd));
                let n = p.numel();
                let maps = if n >= min_8bit_size {
                    Some(self.maps(p.device()))
                } else {
                    None
                };
                let state = self.params[i].get_or_insert_with(|| {
                    let moments = if maps.is_some() {
                        let blocks = n.div_ceil(block_size) as i64;
                        let codes = || Tensor::zeros([n as i64], (Kind::Uint8, p.device()));
                        let scales = || Tensor::zeros([blocks], (Kind::Float, p.device()));
                        Moments::Quantized {
                            m: codes(),
                            m_scale: scales(),
                            s: codes(),
                            s_scale: scales(),
                        }
                    } else {
                        Moments::Full {
                            m: zeros_f32(p),
                            v: zeros_f32(p),
                        }
                    };
                    ParamState { step: 0, moments }
                });
                state.step += 1;
                let correction1 = 1.0 - beta1.powi(state.step);
                let correction2 = 1.0 - beta2.powi(state.step);
                let step_size = -lr / correction1;
                let mut p = p.shallow_clone();
                decay(&mut p, lr, wd);
                match &mut state.moments {
                    Moments::Full { m, v } => {
                        let _ = m.lerp_(&g, 1.0 - beta1);
                        let _ = v.g_mul_scalar_(beta2);
                        let _ = v.g_add_(&(g.square() * (1.0 - beta2)));
                        let denom = v.sqrt() / correction2.sqrt() + eps;
                        let _ = p.g_add_(&(&*m / denom * step_size));
                    }
                    Moments::Quantized {
                        m,
                        m_scale,
                        s,
                        s_scale,
                    } => {
                        let maps = &self.maps[maps.expect("quantized state has maps")];
                        // Work on a flat view of the parameter (a contiguous copy if need be).
                        let flat = p.contiguous().view([-1]);
                        let g = g.reshape([-1]);
                        let chunk = CHUNK.div_ceil(block_size) * block_size;
                        for start in (0..n).step_by(chunk) {
                            let len = chunk.min(n - start) as i64;
                            let (start, block0) = (start as i64, (start / block_size) as i64);
                            let blocks = (len as usize).div_ceil(block_size) as i64;
                            let mut m = m.narrow(0, start, len);
                            let mut m_scale = m_scale.narrow(0, block0, blocks);
                            let mut s = s.narrow(0, start, len);
                            let mut s_scale = s_scale.narrow(0, block0, blocks);
                            let g = g.narrow(0, start, len);
                            let m32 = dequantize(&m, &m_scale, &maps.signed, block_size) * beta1
                                + &g * (1.0 - beta1);
                            let s32 = dequantize(&s, &s_scale, &maps.unsigned, block_size);
                            let s32 = (s32.square() * beta2 + g.square() * (1.0 - beta2)).sqrt();
                            let denom = &s32 / correction2.sqrt() + eps;
                            let _ = flat
                                .narrow(0, start, len)
                                .g_add_(&(&m32 / denom * step_size));
                            quantize(&m32, &mut m, &mut m_scale, &maps.signed_mid, block_size);
                            quantize(&s32, &mut s, &mut s_scale, &maps.unsigned_mid, block_size);
                        }
                        if !p.is_contiguous() {
                            p.copy_(&flat.view(p.size().as_slice()));
                        }
                    }
                }
            }
        })
    }

    fn state_bytes(&self) -> u64 {
        let moments = self
            .params
            .iter()
            .flatten()
            .map(|state| match &state.moments {
                Moments::Full { m, v } => bytes([m, v]),
                Moments::Quantized {
                    m,
                    m_scale,
                    s,
                    s_scale,
                } => bytes([m, m_scale, s, s_scale]),
            });
        let maps = self.maps.iter().map(|maps| {
            bytes([
                &maps.signed,
                &maps.signed_mid,
                &maps.unsigned,
                &maps.unsigned_mid,
            ])
        });
        moments.sum::<u64>() + maps.sum::<u64>()
    }

    fn name(&self) -> &'static str {
        "AdamW8bit"
    }
}
