//! Categories of a known model equal the bytes computed from its tensors (CPU).

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tchmem::{hooks, record, CategoryName};

fn f32_bytes(elements: usize) -> u64 {
    (elements * 4) as u64
}

#[test]
fn parameters_gradients_and_batch_are_counted_exactly() {
    let vs = nn::VarStore::new(Device::Cpu);
    let model = nn::seq()
        .add(nn::linear(vs.root() / "a", 32, 64, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "b", 64, 8, Default::default()));
    let parameters = f32_bytes(32 * 64 + 64 + 64 * 8 + 8);

    // Not watched yet: nothing is attributed.
    assert_eq!(record::current().bytes(CategoryName::Parameters), 0);

    tchmem::watch(&vs);
    tchmem::watch(&vs); // watching twice counts once
    let before = record::current();
    assert_eq!(before.device, "cpu");
    assert!(before.cuda.is_none());
    assert_eq!(before.bytes(CategoryName::Parameters), parameters);
    assert_eq!(before.bytes(CategoryName::Gradients), 0);
    assert!(before.notes.iter().any(|n| n.contains("CUDA-only")));

    let batch = Tensor::randn([16, 32], (Kind::Float, Device::Cpu));
    tchmem::watch_batch(&batch);
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let loss = model.forward(&batch).square().mean(Kind::Float);
    opt.zero_grad();
    loss.backward();

    let after = record::current();
    assert_eq!(after.bytes(CategoryName::Parameters), parameters);
    assert_eq!(after.bytes(CategoryName::Gradients), parameters);
    assert_eq!(after.bytes(CategoryName::InputBatch), f32_bytes(16 * 32));
    assert!(after.categories.iter().all(|c| c.exact));

    // A dropped store stops counting.
    drop((model, opt));
    drop(vs);
    assert_eq!(record::current().bytes(CategoryName::Parameters), 0);
}

#[test]
fn cuda_counters_degrade_with_a_reason() {
    if tch::Cuda::is_available() {
        return; // covered by the GPU runs
    }
    let error = tchmem::cuda_stats::device_stats(0).unwrap_err();
    assert!(error.to_string().contains("not available"), "{error}");
}

#[test]
fn train_step_runs_forward_backward_and_step_with_markers_off_cuda() {
    let vs = nn::VarStore::new(Device::Cpu);
    let model = nn::linear(vs.root(), 3, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let x = Tensor::ones([4, 3], (Kind::Float, Device::Cpu));
    hooks::before_cell();
    let first =
        tchmem::phase::train_step(&mut opt, || model.forward(&x).square().mean(Kind::Float));
    let mut last = first.double_value(&[]);
    for _ in 0..20 {
        let loss =
            tchmem::phase::train_step(&mut opt, || model.forward(&x).square().mean(Kind::Float));
        last = loss.double_value(&[]);
    }
    assert!(last < first.double_value(&[]));
    // Without CUDA the markers measure nothing, and the record says so by having no snapshot.
    assert!(hooks::after_cell().record.at_backward.is_none());
}
