//! Tensors laid end to end in one flat buffer, the shape every collective here sends: one call
//! per bucket or share instead of one per tensor.

use tch::Tensor;

/// The consecutive pieces of the 1-D `flat` from `start`, one per length in `numels`: views, so
/// a copy into one writes `flat`, and a copy from one reads it.
pub(super) fn pieces<'a, N>(
    flat: &'a Tensor,
    start: i64,
    numels: N,
) -> impl Iterator<Item = Tensor> + 'a
where
    N: IntoIterator<Item = i64>,
    N::IntoIter: 'a,
{
    let mut offset = start;
    numels.into_iter().map(move |numel| {
        let piece = flat.narrow(0, offset, numel);
        offset += numel;
        piece
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_are_views_of_consecutive_slices() {
        let flat = Tensor::arange(10, tch::kind::FLOAT_CPU);
        let got: Vec<Vec<f32>> = pieces(&flat, 2, [3, 1, 4])
            .map(|p| Vec::<f32>::try_from(&p).unwrap())
            .collect();
        assert_eq!(got, [vec![2., 3., 4.], vec![5.], vec![6., 7., 8., 9.]]);
        let mut first = pieces(&flat, 0, [2]).next().unwrap();
        let _ = first.fill_(-1.0);
        assert_eq!(flat.double_value(&[1]), -1.0);
    }
}
