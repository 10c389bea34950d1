//! Several processes training one model (data parallel): each process is a rank of a process
//! group of libtorch's c10d (Gloo, on this host), set up once, then used by every cell.
//!
//! ```no_run
//! use tch::nn::{self, OptimizerConfig};
//! # fn main() -> Result<(), tchmem::RuntimeError> {
//! tchmem::dist::init(&tchmem::dist::Setup::from_env()?)?;
//! let vs = nn::VarStore::new(tch::Device::Cpu);
//! let net = nn::linear(vs.root(), 8, 1, Default::default());
//! let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
//! tchmem::dist::broadcast_parameters(&vs)?; // every rank starts from rank 0's parameters
//! # let (x, y) = (tch::Tensor::zeros([4, 8], tch::kind::FLOAT_CPU), tch::Tensor::zeros([4, 1], tch::kind::FLOAT_CPU));
//! // x, y: this rank's share of the batch
//! opt.zero_grad();
//! x.apply(&net).mse_loss(&y, tch::Reduction::Mean).backward();
//! tchmem::dist::all_reduce_gradients(&vs)?; // the mean over ranks, as one process on the whole batch
//! opt.step();
//! # Ok(()) }
//! ```
//!
//! [`ZeroOptimizer`] shares the optimizer state (ZeRO stage 1) and the gradients (stage 2) out
//! among the ranks instead of keeping them whole on each.
//!
//! Without a group (a process of its own) the rank is 0 of 1 and every collective returns at
//! once: a loop written for several processes also runs in one.

mod flat;
mod group;
mod parameters;
mod zero;

pub use group::{all_gather, all_reduce, broadcast, reduce_scatter, ReduceOp};
pub use group::{barrier, init, rank, shutdown, world_size, Setup, DEFAULT_TIMEOUT};
pub use parameters::{all_reduce_gradients, broadcast_parameters, BUCKET_BYTES};
pub use zero::{ZeroOptimizer, ZeroStage};
