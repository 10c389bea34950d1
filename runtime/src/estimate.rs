//! The shapes an estimate of a loop's memory ("will it fit?") is computed from: a VarStore's
//! trainable parameters, sized with `tchmem_wire::estimate` (parameter, gradient and optimizer
//! state bytes, exactly).

use tch::nn::VarStore;
use tch::Tensor;

pub use tchmem_wire::estimate::{
    tensor_bytes, DeviceRoom, ModelShapes, OptimizerRule, ParamShape, DEVICE_ROOM_MIME,
    MODEL_SHAPES_MIME,
};

/// The shape and element size of a tensor.
fn shape(tensor: &Tensor) -> ParamShape {
    ParamShape {
        dims: tensor.size(),
        element_size: tensor.kind().elt_size_in_bytes() as u64,
    }
}

/// Whether a variable of a store's trainable list trains: it takes a gradient now, or holds one
/// from an earlier step. A frozen store's variables (`vs.freeze()`: a fine-tuned backbone, the
/// network of a style transfer) stay in tch's trainable list with `requires_grad` off; they get
/// no gradient and no optimizer state. A store that a loop freezes and unfreezes in turn (a
/// GAN's) still holds its last gradients, so it counts whichever phase it was left in.
fn trains(tensor: &Tensor) -> bool {
    tensor.requires_grad() || tensor.grad().defined()
}

/// The trainable variables of `vs` that train (see [`trains`]), the ones its optimizer keeps
/// state for.
pub fn shapes(vs: &VarStore) -> Vec<ParamShape> {
    vs.trainable_variables()
        .iter()
        .filter(|tensor| trains(tensor))
        .map(shape)
        .collect()
}

/// Where the trainable variables of every live watched store (`tchmem::watch`) are.
pub(crate) fn watched_addresses() -> std::collections::HashSet<usize> {
    let mut addresses = std::collections::HashSet::new();
    crate::watch::each_trainable(|tensor| {
        addresses.insert(tensor.data_ptr() as usize);
    });
    addresses
}

/// The trainable variables that train (see [`trains`]) of every live watched store
/// (`tchmem::watch`) but those at `existing` (the addresses of models that were there before).
pub(crate) fn watched_shapes(existing: &std::collections::HashSet<usize>) -> Vec<ParamShape> {
    let mut shapes = Vec::new();
    crate::watch::each_trainable(|tensor| {
        if !existing.contains(&(tensor.data_ptr() as usize)) && trains(tensor) {
            shapes.push(shape(tensor))
        }
    });
    shapes
}

/// The variables of `stores` (a model's VarStores): what `%memestimate` counts before any
/// training loop has run. Shown to the kernel as [`MODEL_SHAPES_MIME`].
pub fn model(stores: &[&VarStore]) -> Model {
    let mut shapes = ModelShapes::default();
    for store in stores {
        shapes.cuda |= store.device().is_cuda();
        let trainable: Vec<Tensor> = store
            .trainable_variables()
            .into_iter()
            .filter(trains)
            .collect();
        let addresses: std::collections::HashSet<usize> = trainable
            .iter()
            .map(|tensor| tensor.data_ptr() as usize)
            .collect();
        shapes.trainable.extend(trainable.iter().map(shape));
        shapes.per_store.push(trainable.len());
        // One copy of the store's variables (each call locks the store and clones them all).
        let variables = store.variables();
        shapes.frozen_bytes += variables
            .values()
            .filter(|tensor| !addresses.contains(&(tensor.data_ptr() as usize)))
            .map(crate::tensor_bytes)
            .sum::<u64>();
        shapes.gradient_bytes += variables
            .values()
            .map(|tensor| tensor.grad())
            .filter(|grad| grad.defined())
            .map(|grad| crate::tensor_bytes(&grad))
            .sum::<u64>();
    }
    Model(shapes)
}

/// A model's variables, shown as [`MODEL_SHAPES_MIME`].
pub struct Model(pub ModelShapes);

impl Model {
    /// evcxr's hook for showing a cell's value.
    pub fn evcxr_display(&self) {
        crate::display::json_result(MODEL_SHAPES_MIME, &self.0);
    }
}

/// The device's room now: what `%memestimate`, `%memfit` and `%%optimize --fit` fit into.
/// Shown to the kernel as [`DEVICE_ROOM_MIME`]; `None` inside without CUDA.
pub fn room() -> Room {
    let device = crate::cuda_stats::DEVICE;
    let measured = || -> crate::error::Result<DeviceRoom> {
        let stats = crate::cuda_stats::device_stats(device)?;
        let (free, total) = crate::cuda_stats::memory_info(device)?;
        Ok(DeviceRoom {
            total,
            free,
            reserved: stats.current.reserved,
            allocated: stats.current.allocated,
            fraction: crate::cuda_stats::memory_fraction().unwrap_or(1.0),
            context: crate::nvml::process_bytes(device as u32)
                .ok()
                .map(|process| process.saturating_sub(stats.current.reserved)),
        })
    };
    Room(
        tch::Cuda::is_available()
            .then(measured)
            .and_then(Result::ok),
    )
}

/// The device's room, or `None` without CUDA.
pub struct Room(pub Option<DeviceRoom>);

impl Room {
    /// evcxr's hook for showing a cell's value.
    pub fn evcxr_display(&self) {
        crate::display::json_result(DEVICE_ROOM_MIME, &self.0);
    }
}

#[cfg(test)]
mod tests {
    use tch::nn::{self, Module, OptimizerConfig};
    use tch::{Device, Kind, Tensor};

    #[test]
    fn a_frozen_stores_variables_are_held_but_do_not_train() {
        let mut vs = nn::VarStore::new(Device::Cpu);
        let backbone = nn::linear(vs.root() / "backbone", 8, 4, Default::default());
        vs.freeze();
        let head = nn::linear(vs.root() / "head", 4, 2, Default::default());
        let shapes = super::model(&[&vs]).0;
        // The head's weight and bias train; the backbone's 36 values are held (4 bytes each).
        assert_eq!(shapes.trainable.len(), 2);
        assert_eq!(shapes.frozen_bytes, 4 * (8 * 4 + 4));
        assert_eq!(super::shapes(&vs).len(), 2);

        // A frozen variable that holds a gradient from a step before it was frozen still
        // counts: its gradient is there, and the loop may unfreeze it again.
        vs.unfreeze();
        let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
        let x = Tensor::ones([1, 8], (Kind::Float, Device::Cpu));
        opt.backward_step(&head.forward(&backbone.forward(&x)).sum(Kind::Float));
        vs.freeze();
        let shapes = super::model(&[&vs]).0;
        assert_eq!(shapes.trainable.len(), 4);
        // Their gradients are there already: the model's, not other tensors the notebook holds.
        assert_eq!(shapes.gradient_bytes, 4 * (8 * 4 + 4 + 4 * 2 + 2));
    }
}
