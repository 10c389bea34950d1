//! Per-operator recording and replay (CPU, real libtorch): one training step of a small conv
//! net (convolution, BatchNorm, ReLU, max-pool, linear, cross-entropy, SGD with momentum) is
//! recorded at two batch sizes, the operators line up, and the ones a conv net's estimate
//! replays run alone at a larger batch. The recording is process-wide, so this file holds one
//! test.

use tch::nn::{self, ModuleT, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tchmem_wire::op_trace::OpTrace;

fn step_recorded(batch: i64) -> OpTrace {
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let conv = nn::conv2d(
        &root / "conv",
        3,
        8,
        3,
        nn::ConvConfig {
            padding: 1,
            ..Default::default()
        },
    );
    let bn = nn::batch_norm2d(&root / "bn", 8, Default::default());
    let fc = nn::linear(&root / "fc", 8 * 4 * 4, 10, Default::default());
    let net = nn::seq_t()
        .add(conv)
        .add(bn)
        .add_fn(|x| x.relu().max_pool2d_default(2).flatten(1, -1))
        .add(fc);
    let mut opt = nn::Sgd {
        momentum: 0.9,
        ..Default::default()
    }
    .build(&vs, 0.01)
    .unwrap();
    let xs = Tensor::rand([batch, 3, 8, 8], (Kind::Float, Device::Cpu));
    let ys = Tensor::randint(10, [batch], (Kind::Int64, Device::Cpu));
    let ((), trace) = tchmem::op_trace::record(|| {
        let loss = net.forward_t(&xs, true).cross_entropy_for_logits(&ys);
        opt.backward_step(&loss);
    })
    .unwrap();
    trace
}

#[test]
fn a_training_step_is_recorded_operator_by_operator_and_replays_at_another_batch() {
    let small = step_recorded(4);
    let large = step_recorded(8);
    let names = |t: &OpTrace| t.ops.iter().map(|op| op.name.clone()).collect::<Vec<_>>();
    assert_eq!(
        names(&small),
        names(&large),
        "the same operators at both batches"
    );
    assert_ne!(small.id, large.id);
    let index = |name: &str| {
        names(&small)
            .iter()
            .position(|n| n == name)
            .unwrap_or_else(|| panic!("no {name} in {:?}", names(&small)))
    };
    // Forward and backward, each operator once, at the top level: the convolution's inner
    // calls belong to it.
    let backward = [
        "aten::convolution_backward",
        "aten::native_batch_norm_backward",
        "aten::max_pool2d_with_indices_backward",
    ];
    for name in ["aten::conv2d", "aten::batch_norm"].iter().chain(&backward) {
        index(name);
    }
    assert!(
        !names(&small).iter().any(|n| n == "aten::_convolution"),
        "{:?}",
        names(&small)
    );
    // Without CUDA no bytes are measured.
    assert!(small.ops.iter().all(|op| op.start == 0 && op.excess == 0));

    // The backward operators run alone at batch 32, on zero-filled inputs scaled from 4 and 8.
    let indices: Vec<(usize, usize)> = backward
        .iter()
        .map(|name| (index(name), index(name)))
        .collect();
    let replayed = tchmem::op_trace::replay(small.id, large.id, (4, 8), 32, &indices);
    assert_eq!(replayed.0.error, None);
    assert_eq!(replayed.0.excess, vec![Some(0); 3], "each ran");
    // So does every operator of the step.
    let all: Vec<(usize, usize)> = (0..small.ops.len()).map(|i| (i, i)).collect();
    let replayed = tchmem::op_trace::replay(small.id, large.id, (4, 8), 32, &all);
    let failed: Vec<&String> = all
        .iter()
        .filter(|&&(i, _)| replayed.0.excess[i].is_none())
        .map(|&(i, _)| &small.ops[i].name)
        .collect();
    assert!(failed.is_empty(), "not replayed: {failed:?}");
    // Arguments as they lie in memory: a transposed matrix and an index list (Tensor?[]) are
    // rebuilt as such; a slice with gaps is not rebuilt, and its operator keeps its line.
    let views = |batch: i64| {
        let a = Tensor::rand([batch, 6], (Kind::Float, Device::Cpu));
        let w = Tensor::rand([5, 6], (Kind::Float, Device::Cpu));
        let rows = Tensor::from_slice(&[0i64, 2]);
        let ((), trace) = tchmem::op_trace::record(|| {
            let _ = a.matmul(&w.tr());
            let _ = a.index(&[Some(&rows)]);
            let _ = a.narrow(1, 1, 3).contiguous();
        })
        .unwrap();
        trace
    };
    let (small, large) = (views(4), views(8));
    assert_eq!(
        names(&small),
        [
            "aten::t",
            "aten::matmul",
            "aten::index.Tensor",
            "aten::narrow",
            "aten::contiguous"
        ]
    );
    let five: Vec<(usize, usize)> = (0..5).map(|i| (i, i)).collect();
    let replayed = tchmem::op_trace::replay(small.id, large.id, (4, 8), 32, &five);
    assert_eq!(
        replayed.0.excess,
        [Some(0), Some(0), Some(0), Some(0), None]
    );
    // A batch built from one operator per sample: the same matmul is the third operator at 4
    // and the fourth at 8, and replays by its pair of indices.
    let built = |batch: i64| {
        let a = Tensor::rand([batch, 6], (Kind::Float, Device::Cpu));
        let w = Tensor::rand([5, 6], (Kind::Float, Device::Cpu));
        let ((), trace) = tchmem::op_trace::record(|| {
            for i in 0..batch / 4 {
                let _ = a.narrow(0, i, 1);
            }
            let _ = a.matmul(&w.tr());
        })
        .unwrap();
        trace
    };
    let (small, large) = (built(4), built(8));
    assert_eq!(names(&small), ["aten::narrow", "aten::t", "aten::matmul"]);
    assert_eq!(names(&large)[3], "aten::matmul");
    let replayed = tchmem::op_trace::replay(small.id, large.id, (4, 8), 32, &[(2, 3), (1, 2)]);
    assert_eq!(replayed.0.excess, [Some(0), Some(0)]);
    // A panic inside a recording stops it, and the next one records.
    let panicked = std::panic::catch_unwind(|| tchmem::op_trace::record(|| panic!("in a step")));
    assert!(panicked.is_err());
    assert_eq!(names(&views(4)).len(), 5);
    // Recordings that do not line up are refused as a whole, with the reason.
    let unknown = tchmem::op_trace::replay(small.id, 9_999, (4, 8), 32, &indices);
    assert!(unknown.0.error.unwrap().contains("no operator recordings"));
}
