//! Gradient accumulation by micro-batching: a batch is split into K chunks that run forward and
//! backward one after the other, each loss weighted by its share of the batch, then one
//! optimizer step. The gradients equal the full batch's (for a mean-reduced loss), so the
//! effective batch and the learning dynamics stay the same while activations shrink ~K times.
//!
//! ```no_run
//! # use tch::Tensor;
//! # let (xs, ys) = (Tensor::zeros([8, 4], tch::kind::FLOAT_CPU), Tensor::zeros([8], tch::kind::FLOAT_CPU));
//! for (weight, [xs, ys]) in tchmem::accumulate::split(4, [&xs, &ys]) {
//!     // let loss = …; (loss * weight).backward();
//! }
//! ```

use tch::Tensor;

/// Splits the batch tensors along dimension 0 into `k` chunks (fewer if the batch is smaller)
/// and pairs each chunk with its weight, chunk length / batch length.
///
/// # Panics
/// If `k` is 0 or the tensors' first dimensions differ.
pub fn split<const N: usize>(k: i64, batch: [&Tensor; N]) -> Vec<(f64, [Tensor; N])> {
    assert!(
        k >= 1,
        "accumulation needs at least one micro-batch, got {k}"
    );
    let Some(first) = batch.first() else {
        return Vec::new();
    };
    let len = first.size().first().copied().unwrap_or(1);
    for t in &batch {
        let other = t.size().first().copied().unwrap_or(1);
        assert_eq!(
            other, len,
            "micro-batching splits every batch tensor along dim 0; their lengths differ ({len} and {other})"
        );
    }
    let chunks: Vec<Vec<Tensor>> = batch.iter().map(|t| t.chunk(k, 0)).collect();
    (0..chunks[0].len())
        .map(|i| {
            let parts: [Tensor; N] = std::array::from_fn(|j| chunks[j][i].shallow_clone());
            let weight = parts[0].size()[0] as f64 / len as f64;
            (weight, parts)
        })
        .collect()
}

/// The size of the micro-batch `first` (a batch tensor's chunk, its length along dim 0) in the
/// type of the whole batch's size `whole`, for code that spells the batch size out
/// (`xs.view([BATCH_SIZE * SEQ_LEN, labels])`): inside a micro-batch it must read the
/// micro-batch's.
///
/// # Panics
/// If the length does not fit `T`.
pub fn micro_size<T: TryFrom<i64>>(first: &Tensor, whole: T) -> T {
    let _ = whole;
    let len = first.size().first().copied().unwrap_or(1);
    T::try_from(len)
        .unwrap_or_else(|_| panic!("a micro-batch of {len} does not fit the batch size's type"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_micro_batch_size_comes_in_the_batch_sizes_type() {
        let batch = Tensor::zeros([8, 3], (tch::Kind::Float, tch::Device::Cpu));
        let parts = split(3, [&batch]);
        let sizes: Vec<i64> = parts.iter().map(|(_, [p])| micro_size(p, 8i64)).collect();
        assert_eq!(sizes, [3, 3, 2]);
        assert_eq!(micro_size(&parts[2].1[0], 8usize), 2usize);
    }
}
