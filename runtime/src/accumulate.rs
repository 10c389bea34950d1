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
