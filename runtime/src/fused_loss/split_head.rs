//! A head inside a model, taken apart for the fused loss.
//!
//! Models written as tch users write them end in their head: `nn::func_t(move |xs, train| …
//! .apply(&ln_f).apply(&head))`, or `nn::seq_t()…add(nn::linear(…))`. The fused loss needs the
//! hidden states and the head apart, and the model's code should not change its meaning for
//! the rest of the notebook (sampling, evaluation). So the head is marked, not removed: a
//! [`SplitHead`] (or [`tied_head`]) is the head wherever it runs, except inside
//! [`split_head`], where it hands its input and its weights to the caller instead of the
//! logits.
//!
//! ```no_run
//! # use tch::{nn, nn::Module, Device, Kind, Tensor};
//! # let vs = nn::VarStore::new(Device::Cpu);
//! # let p = vs.root();
//! let model = nn::seq()
//!     .add(nn::linear(&p / "body", 32, 64, Default::default()))
//!     .add(tchmem::fused_loss::SplitHead(nn::linear(&p / "head", 64, 1000, Default::default())));
//! # let xs = Tensor::randn([8, 32], (Kind::Float, Device::Cpu));
//! # let ys = Tensor::randint(1000, [8], (Kind::Int64, Device::Cpu));
//! let logits = model.forward(&xs); // the head ran: [8, 1000]
//! let loss = tchmem::fused_loss::split_head(|| model.forward(&xs)).cross_entropy(&ys);
//! ```

use std::cell::RefCell;

use tch::nn::{self, Module};
use tch::Tensor;

use super::FusedLoss;

/// What a head handed over inside [`split_head`].
struct Weights {
    weight: Tensor,
    bias: Option<Tensor>,
    /// Where its input lives and its shape: the forward pass must return that very tensor.
    hidden: (usize, Vec<i64>),
}

/// What a forward pass inside [`split_head`] has met so far.
enum Split {
    /// Inside `split_head`, no head yet.
    Waiting,
    /// A head ran and handed over its weights.
    Met(Weights),
}

thread_local! {
    /// `None` outside [`split_head`]: heads are heads.
    static SPLIT: RefCell<Option<Split>> = const { RefCell::new(None) };
}

/// A linear layer that is a model's output head: the layer itself, except inside
/// [`split_head`]. `SplitHead(nn::linear(…))` owns its layer (a `nn::seq()`'s last); a layer a
/// closure holds is marked where it is applied, `xs.apply(&SplitHead::of(&head))`.
#[derive(Debug)]
pub struct SplitHead(pub nn::Linear);

impl SplitHead {
    /// The head `linear`, sharing its weights (the same tensors, so their gradients are its).
    pub fn of(linear: &nn::Linear) -> SplitHead {
        SplitHead(nn::Linear {
            ws: linear.ws.shallow_clone(),
            bs: linear.bs.as_ref().map(Tensor::shallow_clone),
        })
    }
}

impl Module for SplitHead {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let linear = &self.0;
        handed_over(xs, &linear.ws, linear.bs.as_ref()).unwrap_or_else(|| xs.apply(linear))
    }
}

/// `hidden.matmul(&weight.tr())` (a head tied to an embedding's table `[vocabulary, width]`),
/// except inside [`split_head`].
pub fn tied_head(hidden: &Tensor, weight: &Tensor) -> Tensor {
    handed_over(hidden, weight, None).unwrap_or_else(|| hidden.matmul(&weight.tr()))
}

/// Inside [`split_head`]: takes the head's weights and passes `hidden` on as the output.
fn handed_over(hidden: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Option<Tensor> {
    SPLIT.with(|split| {
        let mut split = split.borrow_mut();
        match split.as_ref()? {
            Split::Waiting => {}
            // The first head's output went on through more layers: what split_head would
            // return is no longer hidden states and a head.
            Split::Met(_) => panic!(
                "tchmem::fused_loss::split_head: the forward pass ran a second output head \
                 after the first; split_head takes models whose output is their head's \
                 (mark only the last layer with SplitHead / tied_head)"
            ),
        }
        *split = Some(Split::Met(Weights {
            weight: weight.shallow_clone(),
            bias: bias.map(Tensor::shallow_clone),
            hidden: identity(hidden),
        }));
        Some(hidden.shallow_clone())
    })
}

/// A model's output before its head: the hidden states and the head's weights.
#[derive(Debug)]
pub struct SplitLogits {
    /// What the head took, `[.., width]`.
    pub hidden: Tensor,
    /// The head's weight, `[vocabulary, width]`.
    pub weight: Tensor,
    /// The head's bias, if it has one.
    pub bias: Option<Tensor>,
}

impl SplitLogits {
    /// The fused loss of these logits (tch's `cross_entropy_for_logits`, see [`FusedLoss`]).
    pub fn cross_entropy(&self, targets: &Tensor) -> Tensor {
        FusedLoss::default().loss_of(self, targets)
    }
}

impl FusedLoss {
    /// The loss of a model's output taken apart by [`split_head`].
    pub fn loss_of(&self, logits: &SplitLogits, targets: &Tensor) -> Tensor {
        self.loss(
            &logits.hidden,
            &logits.weight,
            logits.bias.as_ref(),
            targets,
        )
    }
}

/// Runs `forward` (a model's forward pass, whose last layer is a [`SplitHead`] or a
/// [`tied_head`]) with its head taken apart: the head's input and weights instead of its
/// logits, which are never made.
///
/// # Panics
/// If the forward pass ran no marked head, or ran one and then more layers on its output.
pub fn split_head(forward: impl FnOnce() -> Tensor) -> SplitLogits {
    struct Restore(Option<Split>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let outer = self.0.take();
            SPLIT.with(|split| *split.borrow_mut() = outer);
        }
    }
    // Nested calls (a model that splits another's head inside its forward) each get their own.
    let _restore = Restore(SPLIT.with(|split| split.borrow_mut().replace(Split::Waiting)));
    let output = forward();
    let met = SPLIT.with(|split| split.borrow_mut().replace(Split::Waiting));
    match met {
        Some(Split::Met(Weights {
            weight,
            bias,
            hidden,
        })) if hidden == identity(&output) => SplitLogits {
            hidden: output,
            weight,
            bias,
        },
        Some(Split::Met(_)) => panic!(
            "tchmem::fused_loss::split_head: the forward pass went on after its head (the model \
             returned something other than the head's input): split_head takes models whose \
             last layer is the marked head"
        ),
        _ => panic!(
            "tchmem::fused_loss::split_head: the forward pass ran no head marked for the fused \
             loss: its last layer must be a tchmem::fused_loss::SplitHead (around the \
             nn::linear) or a tchmem::fused_loss::tied_head"
        ),
    }
}

/// A tensor's storage address and shape: the head's input, passed on, keeps both.
fn identity(tensor: &Tensor) -> (usize, Vec<i64>) {
    (tensor.data_ptr() as usize, tensor.size())
}
