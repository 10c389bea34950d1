//! ZeRO (Rajbhandari et al., 2020) stages 1 and 2 over any optimizer: the parameters are shared
//! out among the ranks, and each rank keeps the optimizer state of its own share only, and from
//! the reduction to the next backward pass its share's gradients only (stage 2 reduces them with
//! a reduce-scatter instead of an all-reduce). After each step the ranks swap the parameters
//! they updated, so every rank holds the whole model.
//!
//! The optimizer inside is an ordinary one (tch's `nn::Optimizer` or one of [`crate::optim`]'s),
//! built over the whole store: both create a parameter's state only when they first update it,
//! and skip a parameter without a gradient, so a rank that drops the gradients of the others'
//! parameters before each step never makes their state.

use tch::nn::VarStore;
use tch::{Kind, Tensor};
use tchmem_wire::estimate::zero_owners;

use super::flat::pieces;
use super::group::{all_gather, rank, reduce_scatter, world_size, ReduceOp};
use super::parameters::{average_gradients, by_name, gradient_anywhere};
use crate::error::{Result, RuntimeError};
use crate::keep::set_grad;
use crate::optim::Step;
use crate::tensor_bytes;

/// How much each rank keeps of what training needs besides the parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZeroStage {
    /// Stage 1: the optimizer state of its share of the parameters; the gradients are averaged
    /// whole (an all-reduce), as in data parallel.
    OptimizerState,
    /// Stage 2: the gradients averaged by a reduce-scatter (each rank receives its share's)
    /// instead of an all-reduce. On Gloo this costs more than stage 1 while it runs: libtorch's
    /// Gloo backend reduce-scatters by all-reducing a copy of the whole flat buffer.
    Gradients,
}

impl ZeroStage {
    /// The stage of the ZeRO paper's number (1 or 2).
    pub fn from_number(stage: u8) -> Result<ZeroStage> {
        match stage {
            1 => Ok(ZeroStage::OptimizerState),
            2 => Ok(ZeroStage::Gradients),
            _ => Err(RuntimeError::Invalid(format!(
                "ZeRO stage {stage}: tchmem has stage 1 (optimizer state shared out) and 2 \
                 (gradients too); stage 3 (parameters too) is not built"
            ))),
        }
    }

    /// The paper's number of the stage.
    pub fn number(self) -> u8 {
        match self {
            ZeroStage::OptimizerState => 1,
            ZeroStage::Gradients => 2,
        }
    }
}

/// An optimizer whose state (and at stage 2, gradients) is shared out among the ranks.
///
/// ```no_run
/// use tch::nn::{self, OptimizerConfig};
/// use tchmem::dist::{ZeroOptimizer, ZeroStage};
/// # fn main() -> Result<(), tchmem::RuntimeError> {
/// let vs = nn::VarStore::new(tch::Device::Cpu);
/// let net = nn::linear(vs.root(), 8, 1, Default::default());
/// tchmem::dist::broadcast_parameters(&vs)?;
/// let adam = tchmem::optim::AdamW::default().build(&vs, 1e-3).unwrap();
/// let mut opt = ZeroOptimizer::new(&vs, adam, ZeroStage::Gradients);
/// # let (x, y) = (tch::Tensor::zeros([4, 8], tch::kind::FLOAT_CPU), tch::Tensor::zeros([4, 1], tch::kind::FLOAT_CPU));
/// // x, y: this rank's share of the batch
/// opt.backward_step(&x.apply(&net).mse_loss(&y, tch::Reduction::Mean))?;
/// println!("this rank's optimizer state: {} bytes", opt.inner().state_bytes());
/// # Ok(()) }
/// ```
pub struct ZeroOptimizer<O> {
    inner: O,
    stage: ZeroStage,
    /// The store's trainable variables in name order (the same list on every rank).
    params: Vec<Tensor>,
    /// The rank that updates each of `params`.
    owner: Vec<usize>,
    rank: usize,
    world: usize,
}

impl<O> std::fmt::Debug for ZeroOptimizer<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZeroOptimizer")
            .field("stage", &self.stage.number())
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("params", &self.params.len())
            .field("owned", &self.owned().count())
            .finish()
    }
}

impl<O> ZeroOptimizer<O> {
    /// The optimizer inside (for its state's bytes, say: this rank's share only).
    pub fn inner(&self) -> &O {
        &self.inner
    }

    /// The optimizer inside, to change its learning rate and the like.
    pub fn inner_mut(&mut self) -> &mut O {
        &mut self.inner
    }

    /// The stage.
    pub fn stage(&self) -> ZeroStage {
        self.stage
    }

    /// How many trainable variables this rank updates, of how many.
    pub fn share(&self) -> (usize, usize) {
        (self.owned().count(), self.params.len())
    }

    /// The bytes of the parameters this rank updates.
    pub fn share_bytes(&self) -> u64 {
        self.owned().map(|i| tensor_bytes(&self.params[i])).sum()
    }

    fn owned(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.params.len()).filter(|&i| self.owner[i] == self.rank)
    }

    /// The indices of `params` of each kind, kinds in order of first appearance (the same on
    /// every rank), and within a kind each rank's in index order: `[kind][rank] → indices`.
    fn layout(&self) -> Vec<Vec<Vec<usize>>> {
        let mut kinds: Vec<Kind> = Vec::new();
        let mut layout: Vec<Vec<Vec<usize>>> = Vec::new();
        for (index, param) in self.params.iter().enumerate() {
            let kind = param.kind();
            let position = match kinds.iter().position(|&k| k == kind) {
                Some(position) => position,
                None => {
                    kinds.push(kind);
                    layout.push(vec![Vec::new(); self.world]);
                    kinds.len() - 1
                }
            };
            layout[position][self.owner[index]].push(index);
        }
        layout
    }

    /// Elements of the largest share of one kind: every rank's share is padded to it, as the
    /// collectives need equal slices.
    fn slice_len(&self, shares: &[Vec<usize>]) -> i64 {
        shares
            .iter()
            .map(|share| self.numels(share).iter().sum())
            .max()
            .unwrap_or(0)
    }

    /// The element counts of a share's parameters, in order (owned: the loops that lay them
    /// out write the parameters).
    fn numels(&self, share: &[usize]) -> Vec<i64> {
        share
            .iter()
            .map(|&i| self.params[i].numel() as i64)
            .collect()
    }
}

impl<O: Step> ZeroOptimizer<O> {
    /// Shares out the trainable variables of `vs` among the ranks of the group (join it first;
    /// without one, a world of 1, this rank owns them all): each to the rank with the fewest
    /// bytes so far, the largest first, as PyTorch's `ZeroRedundancyOptimizer` does (the rule
    /// `%memestimate --gpus N --zero S` counts with: [`zero_owners`]). `inner`
    /// must be built over the same store. Build it after the model: variables added to the
    /// store later are neither averaged nor shared out.
    pub fn new(vs: &VarStore, inner: O, stage: ZeroStage) -> ZeroOptimizer<O> {
        let params: Vec<Tensor> = by_name(vs)
            .into_iter()
            .filter(Tensor::requires_grad)
            .collect();
        let world = world_size();
        let owner = zero_owners(&params.iter().map(tensor_bytes).collect::<Vec<_>>(), world);
        ZeroOptimizer {
            inner,
            stage,
            params,
            owner,
            rank: rank(),
            world,
        }
    }

    /// Drops the gradients (the inner optimizer's `zero_grad`).
    pub fn zero_grad(&mut self) {
        self.inner.zero_grad();
    }

    /// Averages the gradients over the ranks (stage 1: all of them; stage 2: each rank receives
    /// its share's and drops the rest), steps this rank's share with the inner optimizer, then
    /// gathers every rank's updated share, so that all ranks hold the same parameters: the step
    /// of one process on the whole batch (when the ranks' batches are equal shares of it and the
    /// loss is a mean).
    pub fn step(&mut self) -> Result<()> {
        if self.world == 1 {
            self.inner.step();
            return Ok(());
        }
        {
            let _no_grad = tch::no_grad_guard();
            match self.stage {
                ZeroStage::OptimizerState => average_gradients(&mut self.params)?,
                ZeroStage::Gradients => self.reduce_scatter_gradients()?,
            }
            // The inner optimizer skips a parameter without a gradient and never makes its state.
            for (param, &owner) in self.params.iter_mut().zip(&self.owner) {
                if owner != self.rank {
                    set_grad(param, None);
                }
            }
        }
        self.inner.step();
        self.gather_parameters()
    }

    /// `zero_grad`, `loss.backward()`, `step`.
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<()> {
        self.zero_grad();
        loss.backward();
        self.step()
    }

    /// Stage 2: the gradients laid out rank by rank, summed by a reduce-scatter of which each
    /// rank keeps its slice, divided by the world size, and put back as its share's gradients.
    fn reduce_scatter_gradients(&mut self) -> Result<()> {
        let anywhere = gradient_anywhere(&self.params)?;
        for shares in self.layout() {
            let slice = self.slice_len(&shares);
            if slice == 0 {
                continue;
            }
            let first = &self.params[shares.iter().flatten().copied().next().unwrap_or(0)];
            let flat = Tensor::zeros([slice * self.world as i64], (first.kind(), first.device()));
            for (rank, share) in shares.iter().enumerate() {
                let start = rank as i64 * slice;
                for (&i, mut piece) in share.iter().zip(pieces(&flat, start, self.numels(share))) {
                    let grad = self.params[i].grad();
                    if grad.defined() {
                        piece.copy_(&grad.reshape([-1]));
                    }
                }
            }
            let mut mine = reduce_scatter(&flat, ReduceOp::Sum)?;
            let _ = mine.g_div_scalar_(self.world as f64);
            let mine_shares = &shares[self.rank];
            for (&i, piece) in mine_shares
                .iter()
                .zip(pieces(&mine, 0, self.numels(mine_shares)))
            {
                if anywhere[i] {
                    // A copy, not a view of `mine`: zero_grad detaches gradients in place, which
                    // libtorch refuses for views.
                    let param = &mut self.params[i];
                    let grad = piece.view_as(param).copy();
                    set_grad(param, Some(&grad));
                }
            }
        }
        Ok(())
    }

    /// After the step: every rank's share of each kind, side by side by an all-gather, copied
    /// into the other ranks' parameters.
    fn gather_parameters(&mut self) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        for shares in self.layout() {
            let slice = self.slice_len(&shares);
            if slice == 0 {
                continue;
            }
            let first = &self.params[shares.iter().flatten().copied().next().unwrap_or(0)];
            let mine = Tensor::zeros([slice], (first.kind(), first.device()));
            let mine_shares = &shares[self.rank];
            for (&i, mut piece) in
                mine_shares
                    .iter()
                    .zip(pieces(&mine, 0, self.numels(mine_shares)))
            {
                piece.copy_(&self.params[i].reshape([-1]));
            }
            let all = all_gather(&mine)?;
            for (rank, share) in shares.iter().enumerate() {
                if rank == self.rank {
                    continue;
                }
                let start = rank as i64 * slice;
                for (&i, piece) in share.iter().zip(pieces(&all, start, self.numels(share))) {
                    let param = &mut self.params[i];
                    param.copy_(&piece.view_as(param));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_are_the_papers_numbers() {
        assert_eq!(
            ZeroStage::from_number(1).unwrap(),
            ZeroStage::OptimizerState
        );
        assert_eq!(ZeroStage::from_number(2).unwrap().number(), 2);
        let error = ZeroStage::from_number(3).unwrap_err().to_string();
        assert!(error.contains("stage 3"), "{error}");
    }
}
