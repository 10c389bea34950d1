//! Micro-batched accumulation gives the full batch's gradients (CPU, real libtorch).

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

fn grads(vs: &nn::VarStore) -> Vec<Tensor> {
    vs.trainable_variables()
        .iter()
        .map(|v| v.grad().copy())
        .collect()
}

#[test]
fn micro_batches_give_the_full_batch_gradients() {
    tch::manual_seed(3);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = nn::seq()
        .add(nn::linear(vs.root() / "a", 12, 32, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "b", 32, 5, Default::default()));
    // 30 is not a multiple of 4: chunks of 8, 8, 8, 6 are weighted by their size.
    let xs = Tensor::randn([30, 12], (Kind::Float, Device::Cpu));
    let ys = Tensor::randint(5, [30], (Kind::Int64, Device::Cpu));

    model.forward(&xs).cross_entropy_for_logits(&ys).backward();
    let full = grads(&vs);
    let full_loss = model
        .forward(&xs)
        .cross_entropy_for_logits(&ys)
        .double_value(&[]);

    for k in [1, 3, 4, 30] {
        for v in vs.trainable_variables() {
            let _ = v.grad().zero_();
        }
        let mut total = 0.0;
        let parts = tchmem::accumulate::split(k, [&xs, &ys]);
        assert_eq!(parts.len() as i64, k.min(30));
        for (weight, [xs, ys]) in parts {
            let loss = model.forward(&xs).cross_entropy_for_logits(&ys) * weight;
            total += loss.double_value(&[]);
            loss.backward();
        }
        let diff = full
            .iter()
            .zip(grads(&vs))
            .map(|(a, b)| (a - b).abs().max().double_value(&[]))
            .fold(0.0, f64::max);
        println!("k = {k}: max |grad diff| = {diff:e}");
        assert!(diff <= 1e-5, "k = {k}: gradients differ by {diff}");
        assert!(
            (total - full_loss).abs() <= 1e-5,
            "k = {k}: loss {total} vs {full_loss}"
        );
    }
}

#[test]
#[should_panic(expected = "lengths differ")]
fn batch_tensors_of_different_lengths_are_refused() {
    let a = Tensor::zeros([4, 2], (Kind::Float, Device::Cpu));
    let b = Tensor::zeros([5], (Kind::Float, Device::Cpu));
    let _ = tchmem::accumulate::split(2, [&a, &b]);
}
