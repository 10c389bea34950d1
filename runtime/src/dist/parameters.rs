//! A model's parameters and gradients across the ranks: the same start everywhere, and each
//! step's gradients averaged, in buckets (one collective per bucket, not per tensor).

use tch::nn::VarStore;
use tch::Tensor;

use super::flat::pieces;
use super::group::{all_reduce, broadcast, world_size, ReduceOp};
use crate::error::{Result, RuntimeError};
use crate::keep::set_grad;
use crate::tensor_bytes;

/// The most bytes of gradients one all-reduce carries (PyTorch DDP's default bucket, 25 MiB).
pub const BUCKET_BYTES: u64 = 25 << 20;

/// The store's variables in name order: the same order on every rank whatever the order the
/// model made them in.
pub(super) fn by_name(vs: &VarStore) -> Vec<Tensor> {
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named.into_iter().map(|(_, tensor)| tensor).collect()
}

/// Copies rank 0's variables (parameters and buffers such as BatchNorm's statistics) into every
/// rank's store, so that all start from the same model. Call once, after building the model.
pub fn broadcast_parameters(vs: &VarStore) -> Result<()> {
    if world_size() == 1 {
        return Ok(());
    }
    let _no_grad = tch::no_grad_guard();
    for mut variable in by_name(vs) {
        broadcast(&mut variable, 0)?;
    }
    Ok(())
}

/// Replaces each trainable variable's gradient with its mean over the ranks: after it, a step
/// on every rank is the step of one process on the whole batch (when the ranks' batches are
/// equal shares of it and the loss is a mean). A variable whose gradient some ranks have and
/// others not (a branch only some batches take) gets zeros where it had none, as in PyTorch's
/// DDP; one that no rank has a gradient for is left without.
pub fn all_reduce_gradients(vs: &VarStore) -> Result<()> {
    if world_size() == 1 {
        return Ok(());
    }
    let mut trainable: Vec<Tensor> = by_name(vs)
        .into_iter()
        .filter(Tensor::requires_grad)
        .collect();
    average_gradients(&mut trainable)
}

/// Which of `variables` (the same list on every rank) any rank has a gradient for: one small
/// all-reduce.
pub(super) fn gradient_anywhere(variables: &[Tensor]) -> Result<Vec<bool>> {
    let had: Vec<f32> = variables
        .iter()
        .map(|v| f32::from(u8::from(v.grad().defined())))
        .collect();
    let mut anywhere = Tensor::from_slice(&had);
    all_reduce(&mut anywhere, ReduceOp::Max)?;
    let anywhere =
        Vec::<f32>::try_from(&anywhere).map_err(|error| RuntimeError::Torch(error.to_string()))?;
    Ok(anywhere.into_iter().map(|any| any != 0.0).collect())
}

/// [`all_reduce_gradients`] over a list of variables (the same on every rank).
pub(super) fn average_gradients(trainable: &mut [Tensor]) -> Result<()> {
    let world = world_size();
    let _no_grad = tch::no_grad_guard();
    let anywhere = gradient_anywhere(trainable)?;
    let mut gradients = Vec::new();
    for (variable, any) in trainable.iter_mut().zip(anywhere) {
        if !any {
            continue;
        }
        if !variable.grad().defined() {
            set_grad(variable, Some(&variable.zeros_like()));
        }
        gradients.push(variable.grad());
    }
    for bucket in buckets(&gradients) {
        average(bucket, world)?;
    }
    Ok(())
}

/// Consecutive gradients of one kind and device, up to [`BUCKET_BYTES`] each (a larger gradient
/// is a bucket of its own).
fn buckets(gradients: &[Tensor]) -> Vec<&[Tensor]> {
    let mut buckets = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (index, gradient) in gradients.iter().enumerate() {
        let size = tensor_bytes(gradient);
        let same = index > start
            && gradient.kind() == gradients[start].kind()
            && gradient.device() == gradients[start].device();
        if index > start && (!same || bytes + size > BUCKET_BYTES) {
            buckets.push(&gradients[start..index]);
            (start, bytes) = (index, 0);
        }
        bytes += size;
    }
    if start < gradients.len() {
        buckets.push(&gradients[start..]);
    }
    buckets
}

/// Averages one bucket's gradients over `world` ranks, in place.
fn average(bucket: &[Tensor], world: usize) -> Result<()> {
    let mut flat = Tensor::cat(
        &bucket.iter().map(|g| g.reshape([-1])).collect::<Vec<_>>(),
        0,
    );
    all_reduce(&mut flat, ReduceOp::Sum)?;
    let _ = flat.g_div_scalar_(world as f64);
    let numels = bucket.iter().map(|g| g.numel() as i64);
    for (gradient, piece) in bucket.iter().zip(pieces(&flat, 0, numels)) {
        gradient.shallow_clone().copy_(&piece.view_as(gradient));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn buckets_keep_kinds_apart_and_stay_under_the_size() {
        let floats = |n: i64| Tensor::zeros([n], (Kind::Float, Device::Cpu));
        let doubles = |n: i64| Tensor::zeros([n], (Kind::Double, Device::Cpu));
        let quarter = (BUCKET_BYTES / 4 / 4) as i64; // a quarter of a bucket, in f32
        let gradients = vec![
            floats(quarter),
            floats(quarter),
            doubles(8),
            doubles(8),
            floats(quarter * 3),
            floats(quarter * 2),
            floats(quarter * 5),
        ];
        let sizes: Vec<usize> = buckets(&gradients).iter().map(|b| b.len()).collect();
        // f32 ×2 | f64 ×2 | ¾ bucket | ½ bucket (¾ + ½ is over) | a gradient larger than a bucket
        assert_eq!(sizes, [2, 2, 1, 1, 1]);
        assert!(buckets(&[]).is_empty());
    }
}
