// %%optimize --compare: the original cell, instrumented by tchmem to stop after the compared steps
use tch::nn::{Module, OptimizerConfig};
use tch::{nn, Device, Kind, Tensor};

/// A small convolutional network for 28x28 images.
#[derive(Debug)]
struct Net {
    conv1: nn::Conv2D,
    conv2: nn::Conv2D,
    fc1: nn::Linear,
    fc2: nn::Linear,
}

impl Net {
    fn new(vs: &nn::Path) -> Net {
        Net {
            conv1: nn::conv2d(vs / "conv1", 1, 32, 5, Default::default()),
            conv2: nn::conv2d(vs / "conv2", 32, 64, 5, Default::default()),
            fc1: nn::linear(vs / "fc1", 1024, 1024, Default::default()),
            fc2: nn::linear(vs / "fc2", 1024, 10, Default::default()),
        }
    }
}

impl Module for Net {
    fn forward(&self, xs: &Tensor) -> Tensor {
        xs.view([-1, 1, 28, 28])
            .apply(&self.conv1)
            .max_pool2d_default(2)
            .apply(&self.conv2)
            .max_pool2d_default(2)
            .view([-1, 1024])
            .apply(&self.fc1)
            .relu()
            .apply(&self.fc2)
    }
}

let device = Device::cuda_if_available();
let vs = nn::VarStore::new(device);
let net = Net::new(&vs.root());
let mut opt: nn::Optimizer = nn::adam(0.9, 0.999, 1e-4).build(&vs, 1e-3).unwrap();
let images = Tensor::rand([2048, 784], (Kind::Float, device));
let labels = Tensor::randint(10, [2048], (Kind::Int64, device));
'tchmem_train: for step in 0..200 {
    tchmem::compare::step_begins();
    let idx = Tensor::randint(2048, [64], (Kind::Int64, device));
    let xs = images.index_select(0, &idx);
    let ys = labels.index_select(0, &idx);
    let loss = net.forward(&xs).cross_entropy_for_logits(&ys);
    opt.backward_step(&loss);
    if step % 50 == 0 {
        println!("step {step}: loss {:.4}", loss.double_value(& []));
    }
    if tchmem::compare::record_step(&loss) {
        break 'tchmem_train;
    }
}
