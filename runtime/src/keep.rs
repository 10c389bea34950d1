//! A model kept across a trial. `%%optimize --compare` and the "will it fit?" magics run the
//! user's training code for a few steps; when its model was made in an earlier cell, those steps
//! would train the notebook's model. The kernel keeps each such `VarStore` first ([`keep`]) and
//! the kept copy puts everything back when it is dropped, a panic or an out-of-memory included:
//! the values of the variables, their gradients (none where there were none), and the store's
//! list of variables (those a trial added are removed). Both sides of a comparison then start
//! from the same weights, and the notebook's model is as it was.
//!
//! The copy is held in host memory, so that it takes no device memory from what a trial
//! measures.

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

/// A `VarStore`'s state, put back when this is dropped.
#[must_use = "the store is put back when the kept copy is dropped"]
pub struct Kept {
    variables: Arc<Mutex<Variables>>,
    /// Each variable (sharing its storage), its values and its gradient, in host memory.
    saved: Vec<(Tensor, Tensor, Option<Tensor>)>,
    names: HashSet<String>,
    trainable: usize,
    /// Where its trainable variables are (see [`kept_addresses`]).
    addresses: Vec<usize>,
}

/// A host copy of `tensor`.
fn host_copy(tensor: &Tensor) -> Tensor {
    let mut copy = Tensor::empty(tensor.size(), (tensor.kind(), Device::Cpu));
    copy.copy_(tensor);
    copy
}

/// Keeps `store`'s variables and gradients until the returned value is dropped.
pub fn keep(store: &VarStore) -> Kept {
    let variables = Arc::clone(&store.variables_);
    let guard = crate::state::lock(&variables);
    let _no_grad = tch::no_grad_guard();
    let saved = guard
        .named_variables
        .values()
        .map(|tensor| {
            let grad = tensor.grad();
            let grad = grad.defined().then(|| host_copy(&grad));
            (tensor.shallow_clone(), host_copy(tensor), grad)
        })
        .collect();
    let names = guard.named_variables.keys().cloned().collect();
    let trainable = guard.trainable_variables.len();
    let addresses: Vec<usize> = guard
        .trainable_variables
        .iter()
        .map(|var| var.tensor.data_ptr() as usize)
        .collect();
    drop(guard);
    crate::state::lock(&KEPT_ADDRESSES).extend(&addresses);
    Kept {
        addresses,
        variables,
        saved,
        names,
        trainable,
    }
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

impl Drop for Kept {
    fn drop(&mut self) {
        let _no_grad = tch::no_grad_guard();
        for (tensor, values, _) in &mut self.saved {
            tensor.copy_(values);
        }
        let on_cuda = self
            .saved
            .iter()
            .any(|(t, _, g)| g.is_some() && t.device().is_cuda());
        if on_cuda {
            // The gradients put back are new device tensors. Made while the trial's blocks are
            // cached, they land inside its large segments and pin them: the next trial then
            // begins with a cache that depends on this one (on an H100 a GRU's 12 MiB gradient
            // held a 386 or a 602 MiB segment, and a trial reserved 2496 MiB where one from the
            // other start reserved 2110 with the same requests). The trial's own gradients go
            // first (cuDNN's RNN makes them as views of one buffer, which holds its segment
            // until the last goes), then the cache: the ones put back get segments of their
            // own, and every trial begins alike.
            for (tensor, _, _) in &mut self.saved {
                set_grad(tensor, None);
            }
            tch::Cuda::synchronize(crate::cuda_stats::DEVICE);
            let _ = crate::cuda_stats::empty_cache();
        }
        for (tensor, _, grad) in &mut self.saved {
            let device_grad = grad.as_ref().map(|g| g.to_device(tensor.device()));
            set_grad(tensor, device_grad.as_ref());
        }
        let mut guard = crate::state::lock(&self.variables);
        let names = &self.names;
        guard.named_variables.retain(|name, _| names.contains(name));
        guard.trainable_variables.truncate(self.trainable);
        drop(guard);
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
}
