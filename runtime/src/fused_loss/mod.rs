//! Fused linear cross-entropy: a language model's output projection and its loss in one, chunk by
//! chunk over the tokens, so that the full logits tensor (tokens × vocabulary: 3.3 GB in f32 for
//! 16k tokens of a 50k vocabulary, and as much again for its softmax and gradient) never exists.
//! The forward pass computes the loss and the gradients of the hidden states, the weight and
//! the bias; backward only scales them.
//!
//! ```no_run
//! # use tch::{nn, nn::Module, Device, Kind, Tensor};
//! # let vs = nn::VarStore::new(Device::Cpu);
//! # let head = nn::linear(vs.root() / "head", 64, 1000, Default::default());
//! # let hidden = Tensor::randn([8, 16, 64], (Kind::Float, Device::Cpu));
//! # let targets = Tensor::randint(1000, [8, 16], (Kind::Int64, Device::Cpu));
//! // hidden.apply(&head).view([-1, 1000]).cross_entropy_for_logits(&targets.view([-1])), fused:
//! let loss = tchmem::fused_loss::linear_cross_entropy(&hidden, &head.ws, head.bs.as_ref(), &targets);
//! ```
//!
//! The loss is tch's `cross_entropy_for_logits`: the mean over the targets that are not -100,
//! the softmax in f32 (f64 for f64 inputs); under `tchmem::amp::autocast` the matmuls run in its
//! dtype, as the unfused head would. The gradients kept between forward and backward are those
//! of the hidden states and the weight (the size of the hidden states and of the weight), so the
//! saving grows with the vocabulary and the number of tokens: at a small vocabulary (a few
//! thousand classes) there is little to save and the chunked matmuls cost time.

use std::ffi::c_char;

use tch::Tensor;
use torch_sys::C_tensor;

use crate::error::{Result, RuntimeError};
use crate::ffi;

extern "C" {
    fn tchmem_fused_linear_cross_entropy(
        hidden: *const C_tensor,
        weight: *const C_tensor,
        bias: *const C_tensor,
        targets: *const C_tensor,
        chunk: i64,
        ignore_index: i64,
        out: *mut *mut C_tensor,
        err: *mut c_char,
        err_len: usize,
    ) -> std::ffi::c_int;
}

/// The target class that `cross_entropy_for_logits` (and this loss) leaves out of the mean.
pub const IGNORE_INDEX: i64 = -100;

/// How the fused loss is computed; [`FusedLoss::default`] is tch's `cross_entropy_for_logits`
/// with chunks sized by the vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FusedLoss {
    /// Tokens per chunk; `None`: as many as make a chunk's logits about the size of the hidden
    /// states (a power of two).
    pub chunk: Option<i64>,
    /// Targets of this class count for nothing (-100, as tch's and PyTorch's).
    pub ignore_index: i64,
}

impl Default for FusedLoss {
    fn default() -> Self {
        FusedLoss {
            chunk: None,
            ignore_index: IGNORE_INDEX,
        }
    }
}

impl FusedLoss {
    /// Tokens per chunk.
    pub fn chunk(self, tokens: i64) -> Self {
        FusedLoss {
            chunk: Some(tokens),
            ..self
        }
    }

    /// The target class left out of the mean.
    pub fn ignore_index(self, class: i64) -> Self {
        FusedLoss {
            ignore_index: class,
            ..self
        }
    }

    /// The mean cross-entropy of `hidden @ weight^T (+ bias)` against `targets`: `hidden` is
    /// `[.., width]`, `weight` `[vocabulary, width]` (a `nn::Linear`'s `ws`, or a tied
    /// embedding's), `bias` `[vocabulary]`, `targets` class indices of `hidden`'s leading shape.
    pub fn try_loss(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        targets: &Tensor,
    ) -> Result<Tensor> {
        if matches!(self.chunk, Some(chunk) if chunk < 1) {
            return Err(RuntimeError::Invalid(format!(
                "fused loss: a chunk of {} tokens (give at least 1)",
                self.chunk.unwrap_or_default()
            )));
        }
        let mut out: *mut C_tensor = std::ptr::null_mut();
        ffi::call(|err, len| unsafe {
            tchmem_fused_linear_cross_entropy(
                hidden.as_ptr(),
                weight.as_ptr(),
                bias.map_or(std::ptr::null(), |b| b.as_ptr()),
                targets.as_ptr(),
                self.chunk.unwrap_or(0),
                self.ignore_index,
                &mut out,
                err,
                len,
            )
        })?;
        // SAFETY: the shim returned a new tensor that we now own.
        Ok(unsafe { Tensor::from_ptr(out) })
    }

    /// [`try_loss`](Self::try_loss), panicking with libtorch's message on error (as tch's own
    /// tensor methods do).
    pub fn loss(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        targets: &Tensor,
    ) -> Tensor {
        self.try_loss(hidden, weight, bias, targets)
            .unwrap_or_else(|e| panic!("{e}"))
    }
}

/// `hidden.apply(&head).cross_entropy_for_logits(&targets)` without the logits: see the module's
/// documentation. `weight` is `[vocabulary, width]`; for a tied head (`x.matmul(&wte.ws.tr())`)
/// it is the embedding's table.
///
/// # Panics
/// On shapes that do not fit together, with libtorch's message.
pub fn linear_cross_entropy(
    hidden: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    targets: &Tensor,
) -> Tensor {
    FusedLoss::default().loss(hidden, weight, bias, targets)
}

mod split_head;

pub use split_head::{split_head, tied_head, SplitHead, SplitLogits};
