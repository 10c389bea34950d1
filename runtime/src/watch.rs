//! What the notebook tells the runtime about its tensors: which variable stores hold model
//! parameters, and which tensor is the current input batch.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, Weak};

use tch::nn::{VarStore, Variables};
use tch::{Device, Tensor};
use tchmem_wire::memory::CategoryName;
use tchmem_wire::timeline::Storage;

/// The watched stores and batch.
#[derive(Default)]
pub struct Watched {
    stores: Vec<Weak<Mutex<Variables>>>,
    batch: Option<Tensor>,
}

fn watched() -> std::sync::MutexGuard<'static, Watched> {
    crate::shared::shared()
        .watched
        .lock()
        .unwrap_or_else(|e| e.into_inner())
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

/// Calls `visit` with every watched tensor and what it is (parameters, gradients, input
/// batch), forgetting stores that were dropped; returns the number of live stores.
fn each_watched(mut visit: impl FnMut(&Tensor, CategoryName)) -> usize {
    let mut watched = watched();
    watched.stores.retain(|w| w.strong_count() > 0);
    let mut stores = 0;
    for store in watched.stores.iter().filter_map(Weak::upgrade) {
        let variables = store.lock().unwrap_or_else(|e| e.into_inner());
        stores += 1;
        for tensor in variables.named_variables.values() {
            visit(tensor, CategoryName::Parameters);
        }
        for var in &variables.trainable_variables {
            let grad = var.tensor.grad();
            if grad.defined() {
                visit(&grad, CategoryName::Gradients);
            }
        }
    }
    if let Some(batch) = &watched.batch {
        visit(batch, CategoryName::InputBatch);
    }
    stores
}

/// Sizes the watched tensors that live on `device`.
pub fn known_bytes(device: Device) -> Known {
    let mut seen = HashSet::new();
    let mut known = Known::default();
    known.stores = each_watched(|tensor, category| {
        let bytes = bytes_once(tensor, device, &mut seen);
        match category {
            CategoryName::Parameters => known.parameters += bytes,
            CategoryName::Gradients => known.gradients += bytes,
            _ => known.input_batch = bytes,
        }
    });
    known
}

/// The device blocks of the watched tensors on CUDA device `device` (for timelines, which tell
/// the allocator's blocks apart by address).
pub(crate) fn storages(device: i64) -> Vec<Storage> {
    let device = Device::Cuda(device as usize);
    let mut found = Vec::new();
    each_watched(|tensor, category| {
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
