// change: line 41: --optimizer lion: nn::adam → tchmem::optim::Lion (one f32 momentum per parameter, Adam keeps two); the settings given to nn::adam are not carried over: tchmem::optim::Lion's defaults apply; learning rate divided by 3 (see the comment in the code)
// change: line 48: --amp bf16: the forward pass and loss run under tchmem::amp::autocast(BFloat16): matmuls and convolutions compute in bf16, so their activations take half the memory; parameters, gradients and optimizer state stay f32
// change: line 48: --accumulate 4: the batch (xs, ys) runs as 4 micro-batches (tchmem::accumulate::split, along dim 0); each micro-batch's loss is weighted by its share of the batch, so the gradients add up to the whole batch's, and the optimizer steps once per batch; `loss` is the whole batch's loss, as before
// change: line 49: phases marked (tchmem::phase: forward, backward, optimizer step), so that the cell's record tells activations and optimizer state apart and %%memprofile shows the phases
// change: --optimizer lion: 1 type annotation nn::Optimizer → tchmem::optim::Optimizer
// %%optimize --amp bf16 --accumulate 4 --optimizer lion: rewritten by tchmem
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
// tchmem: Lion's sign updates move every weight by the whole learning rate, so it needs a
// smaller one than Adam: its authors use 3-10x smaller than AdamW's. This takes lr / 3.
let mut opt: tchmem::optim::Optimizer = tchmem::optim::Lion::default()
    .build(&vs, 1e-3 / 3.0)
    .unwrap();
let images = Tensor::rand([2048, 784], (Kind::Float, device));
let labels = Tensor::randint(10, [2048], (Kind::Int64, device));
for step in 0..200 {
    let idx = Tensor::randint(2048, [64], (Kind::Int64, device));
    let xs = images.index_select(0, &idx);
    let ys = labels.index_select(0, &idx);
    opt.zero_grad();
    let loss = {
        let mut accumulated: Option<tch::Tensor> = None;
        for (weight, [ref xs, ref ys]) in tchmem::accumulate::split(4, [&xs, &ys]) {
            tchmem::phase::forward();
            let loss = tchmem::amp::autocast_on(
                (&vs).device(),
                tch::Kind::BFloat16,
                || {
                    let loss = net.forward(&xs).cross_entropy_for_logits(&ys);
                    loss
                },
            );
            let scaled = &loss * weight;
            tchmem::phase::backward();
            scaled.backward();
            let part = scaled.detach();
            accumulated = Some(
                match accumulated {
                    Some(sum) => sum + part,
                    None => part,
                },
            );
        }
        accumulated.expect("an empty batch")
    };
    tchmem::phase::step();
    opt.step();
    tchmem::phase::end();
    if step % 50 == 0 {
        println!("step {step}: loss {:.4}", loss.double_value(& []));
    }
}
