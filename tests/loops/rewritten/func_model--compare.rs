// %%optimize --compare: the original cell, instrumented by tchmem to stop after the compared steps
use tch::nn::{ModuleT, OptimizerConfig};
use tch::{nn, Device, IndexOp, Kind, Tensor};

const VOCAB: i64 = 256;
const WIDTH: i64 = 32;
const BLOCK: i64 = 16;

fn linear_no_bias(p: nn::Path, in_dim: i64, out_dim: i64) -> nn::Linear {
    let config = nn::LinearConfig {
        bias: false,
        ..Default::default()
    };
    nn::linear(p, in_dim, out_dim, config)
}

fn block(p: nn::Path) -> impl ModuleT {
    let ln = nn::layer_norm(&p / "ln", vec![WIDTH], Default::default());
    let mlp = nn::seq()
        .add(nn::linear(&p / "fc", WIDTH, 4 * WIDTH, Default::default()))
        .add_fn(|xs| xs.gelu("none"))
        .add(nn::linear(&p / "proj", 4 * WIDTH, WIDTH, Default::default()));
    nn::func_t(move |xs, train| xs + xs.apply(&ln).apply(&mlp).dropout(0.1, train))
}

// A character model in the style of tch-rs's min-gpt: built by functions, its head inside.
fn gpt(p: nn::Path) -> impl ModuleT {
    let tok_emb = nn::embedding(&p / "tok_emb", VOCAB, WIDTH, Default::default());
    let pos_emb = p.zeros("pos_emb", &[1, BLOCK, WIDTH]);
    let ln_f = nn::layer_norm(&p / "ln_f", vec![WIDTH], Default::default());
    let head = linear_no_bias(&p / "head", WIDTH, VOCAB);
    let mut blocks = nn::seq_t();
    for i in 0..2 {
        blocks = blocks.add(block(&p / i));
    }
    nn::func_t(move |xs, train| {
        let (_, t) = xs.size2().unwrap();
        (xs.apply(&tok_emb) + pos_emb.i((.., ..t, ..)))
            .apply_t(&blocks, train)
            .apply(&ln_f)
            .apply(&head)
    })
}

let device = Device::cuda_if_available();
let vs = nn::VarStore::new(device);
let model = gpt(vs.root() / "gpt");
let mut opt = nn::AdamW::default().build(&vs, 3e-4)?;
let data = Tensor::randint(VOCAB, [64, BLOCK + 1], (Kind::Int64, device));
'tchmem_train: for epoch in 1..=3 {
    let mut total = 0.0;
    for batch in data.split(16, 0).iter() {
        tchmem::compare::step_begins();
        let xs = batch.narrow(1, 0, BLOCK);
        let ys = batch.narrow(1, 1, BLOCK);
        let logits = xs.apply_t(&model, true);
        let loss = logits
            .view([-1, VOCAB])
            .cross_entropy_for_logits(&ys.reshape([-1]));
        opt.backward_step_clip(&loss, 0.5);
        total += loss.double_value(&[]);
        if tchmem::compare::record_step(&loss) {
            break 'tchmem_train;
        }
    }
    println!("epoch {epoch}: mean loss {:.4}", total / 4.0);
}
