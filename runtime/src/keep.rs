//! A model kept across a trial. `%%optimize --compare` and the "will it fit?" magics run the
//! user's training code for a few steps; when its model was made in an earlier cell, those steps
//! would train the notebook's model. The kernel keeps such `VarStore`s first, all of a run's in
//! one copy ([`keep_all`]; [`keep`] for one), which puts everything back when it is dropped, a
//! panic or an out-of-memory included:
//! the values of the variables, their gradients (none where there were none), and the store's
//! list of variables (those a trial added are removed). Both sides of a comparison then start
//! from the same weights, and the notebook's model is as it was.
//!
//! The copy is held in host memory, so that it takes no device memory from what a trial
//! measures. On CUDA the gradients go back after the trial's own are dropped and the allocator's
//! cache emptied, into segments of their own: the next trial then begins with the same cache
//! whatever this one left (see `Drop`).

use std::collections::HashSet;
use std::ffi::c_char;
use std::ffi::c_int;
use std::sync::{Arc, Mutex};

use tch::nn::{VarStore, Variables};
use tch::{Device, Tensor};
use torch_sys::C_tensor;

use crate::ffi;

/// Where the variables of the stores kept now are: a run's measurements count them as the run's
/// model, though they were there before it began (`compare::begin`). The kernel keeps a store
/// and begins the run in one cell: that cell's copy of this static is enough.
static KEPT_ADDRESSES: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// The addresses of the variables of every store kept now.
pub(crate) fn kept_addresses() -> HashSet<usize> {
    crate::state::lock(&KEPT_ADDRESSES)
        .iter()
        .copied()
        .collect()
}

extern "C" {
    fn tchmem_set_grad(
        tensor: *mut C_tensor,
        grad: *const C_tensor,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
}

/// The state of the `VarStore`s kept for one run, put back when this is dropped.
#[must_use = "the stores are put back when the kept copy is dropped"]
pub struct Kept {
    stores: Vec<KeptStore>,
    /// Where their trainable variables are (see [`kept_addresses`]).
    addresses: Vec<usize>,
}

/// One store's state.
struct KeptStore {
    variables: Arc<Mutex<Variables>>,
    saved: Vec<KeptVariable>,
    names: HashSet<String>,
    trainable: usize,
}

/// One variable of a kept store.
struct KeptVariable {
    /// The variable (sharing its storage).
    tensor: Tensor,
    /// Its values, in host memory.
    values: Tensor,
    /// Its gradient, in host memory.
    grad: Option<Tensor>,
    /// Whether it took gradients: a loop that freezes and unfreezes stores in turn (a GAN's)
    /// leaves them as its last step did.
    requires_grad: bool,
}

/// A host copy of `tensor`.
fn host_copy(tensor: &Tensor) -> Tensor {
    let mut copy = Tensor::empty(tensor.size(), (tensor.kind(), Device::Cpu));
    copy.copy_(tensor);
    copy
}

/// Keeps `store`'s variables and gradients until the returned value is dropped.
pub fn keep(store: &VarStore) -> Kept {
    keep_all(&[store])
}

/// Keeps the variables and gradients of every store in `stores` until the returned value is
/// dropped. One value for them all: their gradients go back after every store's trial gradients
/// are gone (see `Drop`).
pub fn keep_all(stores: &[&VarStore]) -> Kept {
    let _no_grad = tch::no_grad_guard();
    let mut addresses = Vec::new();
    let stores = stores
        .iter()
        .map(|store| {
            let variables = Arc::clone(&store.variables_);
            let guard = crate::state::lock(&variables);
            let saved = guard
                .named_variables
                .values()
                .map(|tensor| {
                    let grad = tensor.grad();
                    KeptVariable {
                        tensor: tensor.shallow_clone(),
                        values: host_copy(tensor),
                        grad: grad.defined().then(|| host_copy(&grad)),
                        requires_grad: tensor.requires_grad(),
                    }
                })
                .collect();
            let names = guard.named_variables.keys().cloned().collect();
            let trainable = guard.trainable_variables.len();
            addresses.extend(
                guard
                    .trainable_variables
                    .iter()
                    .map(|var| var.tensor.data_ptr() as usize),
            );
            drop(guard);
            KeptStore {
                variables,
                saved,
                names,
                trainable,
            }
        })
        .collect();
    crate::state::lock(&KEPT_ADDRESSES).extend(&addresses);
    Kept { stores, addresses }
}

/// Sets `tensor`'s gradient to `grad`, or removes it (a failure is reported, not raised).
pub(crate) fn set_grad(tensor: &mut Tensor, grad: Option<&Tensor>) {
    let grad_ptr = grad.map_or(std::ptr::null(), |g| g.as_ptr());
    let result =
        ffi::call(|err, len| unsafe { tchmem_set_grad(tensor.as_mut_ptr(), grad_ptr, err, len) });
    if let Err(error) = result {
        eprintln!("tchmem: a kept variable's gradient could not be put back: {error}");
    }
}

impl KeptStore {
    /// Puts the values back into the variables' own storage (and whether each takes gradients)
    /// and removes the variables the run added (with whatever they hold).
    fn put_values_back(&mut self) {
        for kept in &mut self.saved {
            if let Err(error) = kept.tensor.f_copy_(&kept.values) {
                eprintln!("tchmem: a kept variable's values could not be put back: {error}");
            }
            if kept.tensor.requires_grad() != kept.requires_grad {
                if let Err(error) = kept.tensor.f_set_requires_grad(kept.requires_grad) {
                    eprintln!(
                        "tchmem: whether a kept variable is frozen could not be put back: {error}"
                    );
                }
            }
        }
        let mut guard = crate::state::lock(&self.variables);
        let names = &self.names;
        guard.named_variables.retain(|name, _| names.contains(name));
        guard.trainable_variables.truncate(self.trainable);
    }

    /// Whether a gradient goes back onto a CUDA device.
    fn puts_gradients_on_cuda(&self) -> bool {
        self.saved
            .iter()
            .any(|kept| kept.grad.is_some() && kept.tensor.device().is_cuda())
    }

    /// Removes the run's gradients.
    fn drop_gradients(&mut self) {
        for kept in &mut self.saved {
            set_grad(&mut kept.tensor, None);
        }
    }

    /// Puts the kept gradients back (none where there were none).
    fn put_gradients_back(&mut self) {
        for KeptVariable { tensor, grad, .. } in &mut self.saved {
            let device_grad = match grad.as_ref().map(|g| g.f_to_device(tensor.device())) {
                Some(Ok(grad)) => Some(grad),
                Some(Err(error)) => {
                    eprintln!("tchmem: a kept variable's gradient could not be put back: {error}");
                    None
                }
                None => None,
            };
            set_grad(tensor, device_grad.as_ref());
        }
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        let _no_grad = tch::no_grad_guard();
        for store in &mut self.stores {
            store.put_values_back();
        }
        if self.stores.iter().any(KeptStore::puts_gradients_on_cuda) {
            // The gradients put back are new device tensors. Made while the run's blocks are
            // cached, they land inside its large segments and pin them: the next trial then
            // begins with a cache that depends on this one (on an H100 a GRU's 12 MiB gradient
            // held a 386 or a 602 MiB segment, and a trial reserved 2496 MiB where one from the
            // other start reserved 2110 with the same requests). Every store's run gradients go
            // first (cuDNN's RNN makes them as views of one buffer, which holds its segment
            // until the last goes), then the cache (freeing a segment waits for the device): the
            // ones put back get segments of their own, and every trial begins alike.
            for store in &mut self.stores {
                store.drop_gradients();
            }
            let _ = crate::cuda_stats::empty_cache();
        }
        for store in &mut self.stores {
            store.put_gradients_back();
        }
        let mut kept = crate::state::lock(&KEPT_ADDRESSES);
        for address in &self.addresses {
            if let Some(at) = kept.iter().position(|a| a == address) {
                kept.swap_remove(at);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tch::nn::{self, Module, OptimizerConfig};
    use tch::{Device, Kind, Tensor};

    use super::keep;

    fn bytes(vs: &nn::VarStore) -> Vec<(String, Vec<f32>, Option<Vec<f32>>)> {
        let mut all: Vec<_> = vs
            .variables()
            .into_iter()
            .map(|(name, t)| {
                let grad = t.grad();
                let grad = grad
                    .defined()
                    .then(|| Vec::<f32>::try_from(grad.flatten(0, -1)).unwrap());
                (name, Vec::<f32>::try_from(t.flatten(0, -1)).unwrap(), grad)
            })
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    #[test]
    fn a_trial_on_a_kept_store_leaves_it_as_it_was() {
        let vs = nn::VarStore::new(Device::Cpu);
        let net = nn::linear(vs.root() / "fc", 4, 2, Default::default());
        let before = bytes(&vs);
        assert!(before.iter().all(|(_, _, grad)| grad.is_none()));
        {
            let _kept = keep(&vs);
            let mut opt = nn::Adam::default().build(&vs, 0.1).unwrap();
            for _ in 0..3 {
                let loss = net
                    .forward(&Tensor::ones([3, 4], (Kind::Float, Device::Cpu)))
                    .sum(Kind::Float);
                opt.backward_step(&loss);
            }
            // A trial that adds a variable to the store.
            let _extra = vs.root().zeros("extra", &[5]);
            assert_ne!(bytes(&vs), before);
        }
        assert_eq!(bytes(&vs), before);

        // Gradients there before are put back too.
        let loss = net
            .forward(&Tensor::ones([1, 4], (Kind::Float, Device::Cpu)))
            .sum(Kind::Float);
        loss.backward();
        let with_grads = bytes(&vs);
        assert!(with_grads.iter().all(|(_, _, grad)| grad.is_some()));
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _kept = keep(&vs);
            let mut opt = nn::Sgd::default().build(&vs, 1.0).unwrap();
            opt.zero_grad();
            let loss = net
                .forward(&Tensor::ones([2, 4], (Kind::Float, Device::Cpu)))
                .sum(Kind::Float);
            opt.backward_step(&loss);
            panic!("out of memory, say");
        }));
        assert!(result.is_err());
        assert_eq!(bytes(&vs), with_grads);
    }

    #[test]
    fn stores_kept_together_are_all_put_back() {
        // A GAN's generator and critic: the critic with gradients, the generator without.
        let (gen, critic) = (
            nn::VarStore::new(Device::Cpu),
            nn::VarStore::new(Device::Cpu),
        );
        let g = nn::linear(gen.root() / "g", 3, 3, Default::default());
        let c = nn::linear(critic.root() / "c", 3, 1, Default::default());
        let input = Tensor::ones([2, 3], (Kind::Float, Device::Cpu));
        c.forward(&g.forward(&input).detach())
            .sum(Kind::Float)
            .backward();
        let before = (bytes(&gen), bytes(&critic));
        {
            let _kept = super::keep_all(&[&gen, &critic]);
            let mut g_opt = nn::Sgd::default().build(&gen, 1.0).unwrap();
            let mut c_opt = nn::Sgd::default().build(&critic, 1.0).unwrap();
            g_opt.zero_grad();
            c_opt.backward_step(&c.forward(&g.forward(&input)).sum(Kind::Float));
            g_opt.step();
            let _extra = critic.root().zeros("extra", &[2]);
            assert_ne!((bytes(&gen), bytes(&critic)), before);
        }
        assert_eq!((bytes(&gen), bytes(&critic)), before);
        assert!(before.0.iter().all(|(_, _, grad)| grad.is_none()));
        assert!(before.1.iter().all(|(_, _, grad)| grad.is_some()));
    }

    #[test]
    fn a_trial_that_freezes_and_unfreezes_stores_leaves_each_as_it_was() {
        let trains = |vs: &nn::VarStore| -> Vec<bool> {
            vs.trainable_variables()
                .iter()
                .map(|t| t.requires_grad())
                .collect()
        };
        let mut gen = nn::VarStore::new(Device::Cpu);
        let mut critic = nn::VarStore::new(Device::Cpu);
        let _g = nn::linear(gen.root() / "g", 3, 3, Default::default());
        let _c = nn::linear(critic.root() / "c", 3, 1, Default::default());
        critic.freeze();
        {
            let _kept = super::keep_all(&[&gen, &critic]);
            // A GAN's loop as it leaves its stores: the other way round.
            gen.freeze();
            critic.unfreeze();
        }
        assert_eq!(trains(&gen), vec![true, true]);
        assert_eq!(trains(&critic), vec![false, false]);
    }
}
