//! What the notebook tells the runtime about its tensors: which variable stores hold model
//! parameters, and which tensor is the current input batch.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use tch::nn::{VarStore, Variables};
use tch::{Device, Tensor};
use tchmem_wire::memory::CategoryName;
use tchmem_wire::timeline::Storage;

use crate::state::{self, Watched};

fn watched() -> MutexGuard<'static, Watched> {
    state::lock(&state::shared().watched)
}

/// How a walk over the watched tensors takes its locks.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Locking {
    /// Waits for them.
    Wait,
    /// Gives up when one is busy (inside libtorch's OOM observer, which must never block).
    Try,
}

/// Locks `mutex` (tolerating poison), or `None` when it is busy and `how` is [`Locking::Try`].
fn lock<T>(mutex: &Mutex<T>, how: Locking) -> Option<MutexGuard<'_, T>> {
    match how {
        Locking::Wait => Some(state::lock(mutex)),
        Locking::Try => state::try_lock(mutex),
    }
}

/// Counts `vs`'s variables as parameters and their gradients as gradients in every later memory
/// record. The store is not kept alive by this: once dropped it stops counting.
pub fn watch(vs: &VarStore) {
    let mut watched = watched();
    let weak = Arc::downgrade(&vs.variables_);
    if !watched.stores.iter().any(|w| w.ptr_eq(&weak)) {
        watched.stores.push(weak);
    }
}

/// Counts `batch` as the input batch (replacing the previous one). The runtime keeps a
/// reference to it until the next call, which keeps its memory alive as long.
pub fn watch_batch(batch: &Tensor) {
    watched().batch = Some(batch.shallow_clone());
}

/// Bytes of tensors on `device`, each storage counted once.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Known {
    /// Variables of watched stores.
    pub parameters: u64,
    /// Their defined gradients.
    pub gradients: u64,
    /// The watched batch.
    pub input_batch: u64,
    /// Number of live watched stores.
    pub stores: usize,
}

/// Calls `visit` with the variables of every live store in `watched`, forgetting stores that
/// were dropped; returns the number of live stores, or `None` when a store's lock was busy
/// (with [`Locking::Try`]; `visit` may then have seen some of the stores).
fn each_store(
    watched: &mut Watched,
    how: Locking,
    mut visit: impl FnMut(&Variables),
) -> Option<usize> {
    watched.stores.retain(|w| w.strong_count() > 0);
    let mut stores = 0;
    for store in watched.stores.iter().filter_map(Weak::upgrade) {
        visit(&*lock(&store, how)?);
        stores += 1;
    }
    Some(stores)
}

/// Calls `visit` with every watched tensor and what it is (parameters, gradients, input
/// batch); returns the number of live stores, or `None` when a lock was busy (as
/// [`each_store`]).
fn each_watched(how: Locking, mut visit: impl FnMut(&Tensor, CategoryName)) -> Option<usize> {
    let mut watched = lock(&state::shared().watched, how)?;
    let stores = each_store(&mut watched, how, |variables| {
        for tensor in variables.named_variables.values() {
            visit(tensor, CategoryName::Parameters);
        }
        for var in &variables.trainable_variables {
            let grad = var.tensor.grad();
            if grad.defined() {
                visit(&grad, CategoryName::Gradients);
            }
        }
    })?;
    if let Some(batch) = &watched.batch {
        visit(batch, CategoryName::InputBatch);
    }
    Some(stores)
}

/// Sizes the watched tensors that live on `device`.
pub fn known_bytes(device: Device) -> Known {
    sized(device, Locking::Wait).expect("waiting always locks")
}

/// [`known_bytes`] without waiting: `None` when the watched tensors are busy (for libtorch's
/// OOM observer, which may run while this or another thread holds their locks).
pub(crate) fn try_known_bytes(device: Device) -> Option<Known> {
    sized(device, Locking::Try)
}

fn sized(device: Device, how: Locking) -> Option<Known> {
    let mut seen = HashSet::new();
    let mut known = Known::default();
    known.stores = each_watched(how, |tensor, category| {
        let bytes = bytes_once(tensor, device, &mut seen);
        match category {
            CategoryName::Parameters => known.parameters += bytes,
            CategoryName::Gradients => known.gradients += bytes,
            _ => known.input_batch = bytes,
        }
    })?;
    Some(known)
}

/// Calls `visit` with the trainable variables of every live watched store (what an estimate
/// sizes parameters, gradients and optimizer state from).
pub(crate) fn each_trainable(mut visit: impl FnMut(&Tensor)) {
    each_store(&mut watched(), Locking::Wait, |variables| {
        variables
            .trainable_variables
            .iter()
            .for_each(|var| visit(&var.tensor))
    });
}

/// The device blocks of the watched tensors on CUDA device `device` (for timelines, which tell
/// the allocator's blocks apart by address).
pub(crate) fn storages(device: i64) -> Vec<Storage> {
    let device = Device::Cuda(device as usize);
    let mut found = Vec::new();
    each_watched(Locking::Wait, |tensor, category| {
        // Watched tensors are whole storages (a VarStore's variables, their gradients, a
        // batch), so their data pointer is their block's address.
        if tensor.defined() && tensor.device() == device {
            found.push(Storage {
                address: tensor.data_ptr() as u64,
                bytes: tensor_bytes(tensor),
                category,
            });
        }
    });
    found
}

/// Bytes of `tensor` if it is on `device` and its storage was not counted yet.
fn bytes_once(tensor: &Tensor, device: Device, seen: &mut HashSet<usize>) -> u64 {
    if !tensor.defined() || tensor.device() != device {
        return 0;
    }
    let pointer = tensor.data_ptr() as usize;
    if pointer != 0 && !seen.insert(pointer) {
        return 0;
    }
    tensor_bytes(tensor)
}

/// `numel × element size` of a tensor.
pub fn tensor_bytes(tensor: &Tensor) -> u64 {
    (tensor.numel() * tensor.kind().elt_size_in_bytes()) as u64
}
