//! GPU benchmark of the `%%optimize` techniques on a GPT (pre-LayerNorm, causal SDPA attention,
//! tied embeddings; ~216M parameters at the default size), one technique at a time and all
//! combined. Prints one JSON line per configuration: peak allocated/reserved bytes and step
//! times. `scripts/gpu/bench_pytorch.py` builds the same model in PyTorch for the comparison.
//!
//!     gpt_bench [--steps N] [--batch B] [--seq T] [--layers L] [CONFIG...]
//!
//! CONFIGs: plain checkpoint bf16 f16 accumulate4 sgd lion adamw8bit adafactor combined, and
//! bf16-tch-adamw / f16-tch-adamw (mixed precision with tch's own AdamW, where `%%optimize --amp`
//! uses tchmem's fused one: the optimizer's share of the step time); the techniques beyond
//! PyTorch's built-in ones: fused-loss, fused-loss-bf16, step-in-backward, offload (with
//! checkpointing), compress-int8 (with checkpointing), and lowest (checkpointing, offload, bf16,
//! the fused loss and Adafactor stepped in backward).

use std::time::Instant;

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tchmem::optim::Step;

pub const VOCAB: i64 = 50304;
const WIDTH: i64 = 1024;
const HEADS: i64 = 16;

#[derive(Debug)]
struct Block {
    ln1: nn::LayerNorm,
    attn: nn::Linear,
    attn_proj: nn::Linear,
    ln2: nn::LayerNorm,
    fc: nn::Linear,
    fc_proj: nn::Linear,
}

impl Block {
    fn new(p: nn::Path) -> Block {
        let ln = || nn::LayerNormConfig::default();
        Block {
            ln1: nn::layer_norm(&p / "ln1", vec![WIDTH], ln()),
            attn: nn::linear(&p / "attn", WIDTH, 3 * WIDTH, Default::default()),
            attn_proj: nn::linear(&p / "attn_proj", WIDTH, WIDTH, Default::default()),
            ln2: nn::layer_norm(&p / "ln2", vec![WIDTH], ln()),
            fc: nn::linear(&p / "fc", WIDTH, 4 * WIDTH, Default::default()),
            fc_proj: nn::linear(&p / "fc_proj", 4 * WIDTH, WIDTH, Default::default()),
        }
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> Tensor {
        let (b, t, c) = x.size3().unwrap();
        let qkv = self.attn.forward(&self.ln1.forward(x));
        let heads = |part: &Tensor| part.view([b, t, HEADS, c / HEADS]).transpose(1, 2);
        let parts = qkv.split(c, 2);
        let y = Tensor::scaled_dot_product_attention(
            &heads(&parts[0]),
            &heads(&parts[1]),
            &heads(&parts[2]),
            None::<Tensor>,
            0.0,
            true,
            None,
            false,
        );
        let y = y.transpose(1, 2).contiguous().view([b, t, c]);
        let x = x + self.attn_proj.forward(&y);
        let h = self.fc.forward(&self.ln2.forward(&x)).gelu("none");
        &x + self.fc_proj.forward(&h)
    }
}

pub struct Gpt {
    wte: nn::Embedding,
    wpe: nn::Embedding,
    blocks: Box<dyn Module>,
    ln_f: nn::LayerNorm,
}

impl Gpt {
    pub fn new(vs: &nn::VarStore, layers: i64, seq: i64, checkpoint: bool) -> Gpt {
        Gpt::with_kept_inputs(vs, layers, seq, checkpoint, Default::default())
    }

    /// A GPT whose checkpointed segments keep their inputs as `keep` says.
    pub fn with_kept_inputs(
        vs: &nn::VarStore,
        layers: i64,
        seq: i64,
        checkpoint: bool,
        keep: tchmem::checkpoint::Keep,
    ) -> Gpt {
        let root = vs.root();
        let blocks: Box<dyn Module> = if checkpoint {
            // Every block its own segment, as torch.utils.checkpoint.checkpoint_sequential with
            // one segment per block: all but the last recomputed in backward.
            let mut s = tchmem::checkpoint::seq().segments(layers as usize);
            if keep.offload {
                s = s.offload();
            }
            if let Some(compression) = keep.compression {
                s = s.compress(compression);
            }
            for i in 0..layers {
                s = s.add(Block::new(&root / "h" / i));
            }
            Box::new(s)
        } else {
            let mut s = nn::seq();
            for i in 0..layers {
                s = s.add(Block::new(&root / "h" / i));
            }
            Box::new(s)
        };
        Gpt {
            wte: nn::embedding(&root / "wte", VOCAB, WIDTH, embedding_init()),
            wpe: nn::embedding(&root / "wpe", seq, WIDTH, embedding_init()),
            blocks,
            ln_f: nn::layer_norm(&root / "ln_f", vec![WIDTH], Default::default()),
        }
    }

    pub fn loss(&self, idx: &Tensor, targets: &Tensor) -> Tensor {
        self.loss_with(idx, targets, None)
    }

    /// The loss, with the tied head and the cross-entropy fused (`tchmem::fused_loss`, as
    /// `fused` says) or not.
    pub fn loss_with(
        &self,
        idx: &Tensor,
        targets: &Tensor,
        fused: Option<tchmem::fused_loss::FusedLoss>,
    ) -> Tensor {
        let (_, t) = idx.size2().unwrap();
        let pos = Tensor::arange(t, (Kind::Int64, idx.device()));
        let x = self.wte.forward(idx) + self.wpe.forward(&pos);
        let x = self.ln_f.forward(&self.blocks.forward(&x));
        if let Some(fused) = fused {
            return fused.loss(&x, &self.wte.ws, None, targets);
        }
        // Tied output head.
        let logits = x.matmul(&self.wte.ws.tr());
        logits.view([-1, VOCAB]).cross_entropy_loss(
            &targets.view([-1]),
            None::<Tensor>,
            tch::Reduction::Mean,
            -100,
            0.0,
        )
    }
}

/// GPT-2's N(0, 0.02) for embeddings (the tied head would start with huge logits otherwise).
fn embedding_init() -> nn::EmbeddingConfig {
    nn::EmbeddingConfig {
        ws_init: nn::Init::Randn {
            mean: 0.0,
            stdev: 0.02,
        },
        ..Default::default()
    }
}

enum Opt {
    Tch(nn::Optimizer),
    Ours(tchmem::optim::Optimizer),
    InBackward(tchmem::optim::InBackward),
}

impl Step for Opt {
    fn step(&mut self) {
        match self {
            Opt::Tch(o) => o.step(),
            Opt::Ours(o) => o.step(),
            Opt::InBackward(o) => o.step(),
        }
    }
    fn zero_grad(&mut self) {
        match self {
            Opt::Tch(o) => o.zero_grad(),
            Opt::Ours(o) => o.zero_grad(),
            Opt::InBackward(o) => o.zero_grad(),
        }
    }
}

/// With GPT_BENCH_PHASES=1: (point, allocated, peak allocated) at each point of the run, to find
/// where two frameworks' memory first differs (bench_pytorch.py records the same points).
struct Phases(Option<Vec<serde_json::Value>>);

impl Phases {
    fn new() -> Phases {
        Phases((std::env::var("GPT_BENCH_PHASES").as_deref() == Ok("1")).then(Vec::new))
    }
    fn mark(&mut self, point: &str) {
        if let Some(points) = &mut self.0 {
            tch::Cuda::synchronize(0);
            if let Ok(s) = tchmem::cuda_stats::device_stats(0) {
                points.push(serde_json::json!([
                    point,
                    s.current.allocated,
                    s.peak.allocated
                ]));
            }
        }
    }
}

fn sync(device: Device) {
    if device.is_cuda() {
        tch::Cuda::synchronize(0);
    }
}

struct Config {
    checkpoint: bool,
    amp: Option<Kind>,
    micro_batches: i64,
    optimizer: &'static str,
    fused_loss: Option<tchmem::fused_loss::FusedLoss>,
    in_backward: bool,
    keep: tchmem::checkpoint::Keep,
}

fn config(name: &str) -> Config {
    let plain = Config {
        checkpoint: false,
        amp: None,
        micro_batches: 1,
        optimizer: "adamw",
        fused_loss: None,
        in_backward: false,
        keep: tchmem::checkpoint::Keep::default(),
    };
    match name {
        "plain" => plain,
        "checkpoint" => Config {
            checkpoint: true,
            ..plain
        },
        // As `%%optimize --amp` rewrites a loop: tch's AdamW becomes tchmem's fused one.
        "bf16" | "bf16-tch-adamw" => Config {
            amp: Some(Kind::BFloat16),
            optimizer: if name == "bf16" {
                "adamw-fused"
            } else {
                "adamw"
            },
            ..plain
        },
        "f16" | "f16-tch-adamw" => Config {
            amp: Some(Kind::Half),
            optimizer: if name == "f16" {
                "adamw-fused"
            } else {
                "adamw"
            },
            ..plain
        },
        "accumulate4" => Config {
            micro_batches: 4,
            ..plain
        },
        "sgd" | "lion" | "adamw8bit" | "adafactor" => Config {
            optimizer: match name {
                "sgd" => "sgd",
                "lion" => "lion",
                "adamw8bit" => "adamw8bit",
                _ => "adafactor",
            },
            ..plain
        },
        "combined" => Config {
            checkpoint: true,
            amp: Some(Kind::BFloat16),
            micro_batches: 4,
            optimizer: "adafactor",
            ..plain
        },
        "fused-loss" => Config {
            fused_loss: Some(Default::default()),
            ..plain
        },
        "fused-loss-bf16" => Config {
            fused_loss: Some(Default::default()),
            amp: Some(Kind::BFloat16),
            optimizer: "adamw-fused",
            ..plain
        },
        // tch's AdamW has no per-parameter step: the rewrite makes it tchmem's (the same update).
        "step-in-backward" => Config {
            in_backward: true,
            optimizer: "adamw-fused",
            ..plain
        },
        "offload" => Config {
            checkpoint: true,
            keep: tchmem::checkpoint::Keep {
                offload: true,
                compression: None,
            },
            ..plain
        },
        "compress-int8" => Config {
            checkpoint: true,
            keep: tchmem::checkpoint::Keep {
                offload: false,
                compression: Some(tchmem::checkpoint::Compression::Int8),
            },
            ..plain
        },
        "lowest" => Config {
            checkpoint: true,
            amp: Some(Kind::BFloat16),
            optimizer: "adafactor",
            fused_loss: Some(Default::default()),
            in_backward: true,
            keep: tchmem::checkpoint::Keep {
                offload: true,
                compression: None,
            },
            ..plain
        },
        // The same with the fused loss in chunks of 128 tokens: smaller temporaries, more matmuls.
        "lowest-128" => Config {
            fused_loss: Some(tchmem::fused_loss::FusedLoss::default().chunk(128)),
            ..config("lowest")
        },
        other => panic!("unknown configuration {other}"),
    }
}

fn build_optimizer(name: &str, vs: &nn::VarStore) -> Opt {
    let lr = 3e-4;
    match name {
        "adamw" => Opt::Tch(nn::AdamW::default().build(vs, lr).unwrap()),
        "adamw-fused" => Opt::Ours(tchmem::optim::AdamW::default().build(vs, lr).unwrap()),
        "sgd" => Opt::Ours(tchmem::optim::Sgd::default().build(vs, lr).unwrap()),
        "lion" => Opt::Ours(tchmem::optim::Lion::default().build(vs, lr / 3.0).unwrap()),
        "adamw8bit" => Opt::Ours(tchmem::optim::AdamW8bit::default().build(vs, lr).unwrap()),
        "adafactor" => Opt::Ours(tchmem::optim::Adafactor::default().build(vs, lr).unwrap()),
        other => panic!("unknown optimizer {other}"),
    }
}

/// `--rounds N --steps N --batch B --layers L` of the benchmarks that alternate modes in one
/// process (timeline_bench, live_bench), over the given defaults.
pub fn mode_flags(
    mut args: impl Iterator<Item = String>,
    defaults: (usize, usize, i64, i64),
) -> (usize, usize, i64, i64) {
    let (mut rounds, mut steps, mut batch, mut layers) = defaults;
    while let Some(flag) = args.next() {
        let value: i64 = args
            .next()
            .expect("a value after the flag")
            .parse()
            .unwrap();
        match flag.as_str() {
            "--rounds" => rounds = value as usize,
            "--steps" => steps = value as usize,
            "--batch" => batch = value,
            "--layers" => layers = value,
            other => panic!("unknown flag {other} (--rounds, --steps, --batch, --layers)"),
        }
    }
    (rounds, steps, batch, layers)
}

pub fn run(
    name: &str,
    steps: usize,
    batch: i64,
    seq: i64,
    layers: i64,
    device: Device,
) -> serde_json::Value {
    let cfg = config(name);
    let mut phases = Phases::new();
    tch::manual_seed(0);
    let vs = nn::VarStore::new(device);
    let model = Gpt::with_kept_inputs(&vs, layers, seq, cfg.checkpoint, cfg.keep);
    phases.mark("model");
    let parameters: i64 = vs
        .trainable_variables()
        .iter()
        .map(|t| t.numel() as i64)
        .sum();
    let mut opt = match build_optimizer(cfg.optimizer, &vs) {
        Opt::Ours(o) if cfg.in_backward => Opt::InBackward(o.in_backward()),
        other => other,
    };
    let mut scaler = (cfg.amp == Some(Kind::Half)).then(|| tchmem::amp::GradScaler::new(&vs));
    let idx = Tensor::randint(VOCAB, [batch, seq], (Kind::Int64, device));
    let targets = Tensor::randint(VOCAB, [batch, seq], (Kind::Int64, device));
    sync(device);
    phases.mark("data");
    let _ = tchmem::cuda_stats::reset_peak_stats(0);
    phases.mark("reset");

    let mut times = Vec::new();
    let mut losses = Vec::new();
    // With GPT_BENCH_HISTORY set, the step carries tchmem's phase markers (which the timeline
    // stamps on each allocation), and "trace" or "stacks" record the allocation history.
    let history = std::env::var("GPT_BENCH_HISTORY").ok();
    let marks = history.is_some();
    let mark = |phase: fn()| {
        if marks {
            phase()
        }
    };
    if let Some(mode @ ("trace" | "stacks")) = history.as_deref() {
        let snapshot = std::env::var("GPT_BENCH_SNAPSHOT")
            .unwrap_or_else(|_| "/tmp/gpt_bench_timeline.pickle".into());
        tchmem::timeline::begin(tchmem::timeline::Request {
            snapshot,
            stacks: mode == "stacks",
            max_entries: 1_000_000,
            steps: None,
        })
        .expect("allocation history");
    }
    // With GPT_BENCH_LIVE set, each loop body starts with the check the kernel puts there
    // (live_bench measures what it and the live view's sampling cost).
    let live = std::env::var_os("GPT_BENCH_LIVE").is_some();
    for _ in 0..steps {
        if live {
            tchmem::__at_loop!(1, "");
        }
        let start = Instant::now();
        opt.zero_grad();
        let mut total = 0.0;
        for (weight, [x, y]) in tchmem::accumulate::split(cfg.micro_batches, [&idx, &targets]) {
            if live {
                tchmem::__at_loop!(2, "");
            }
            mark(tchmem::phase::forward);
            let loss = match cfg.amp {
                Some(kind) => {
                    tchmem::amp::autocast(kind, || model.loss_with(&x, &y, cfg.fused_loss))
                }
                None => model.loss_with(&x, &y, cfg.fused_loss),
            };
            let loss = loss * weight;
            phases.mark("forward");
            mark(tchmem::phase::backward);
            match &scaler {
                Some(s) => s.scale(&loss).backward(),
                None => loss.backward(),
            }
            phases.mark("backward");
            total += loss.double_value(&[]);
        }
        mark(tchmem::phase::step);
        match scaler.as_mut() {
            Some(s) => {
                s.step(&mut opt);
            }
            None => opt.step(),
        }
        mark(tchmem::phase::end);
        sync(device);
        phases.mark("step");
        times.push(start.elapsed().as_secs_f64());
        losses.push(total);
    }
    let stats = tchmem::cuda_stats::device_stats(0).ok();
    let timeline = tchmem::timeline::finish().map(|c| {
        serde_json::json!({
            "snapshot": c.snapshot, "error": c.error, "steps": c.steps,
        })
    });
    let state_bytes = match &opt {
        Opt::Ours(o) => Some(o.state_bytes()),
        Opt::InBackward(o) => Some(o.state_bytes()),
        Opt::Tch(_) => None,
    };
    let mut sorted = times[1..].to_vec();
    sorted.sort_by(f64::total_cmp);
    serde_json::json!({
        "framework": "tch",
        "config": name,
        "optimizer": if cfg.in_backward {
            format!("{}-in-backward", cfg.optimizer)
        } else {
            cfg.optimizer.to_string()
        },
        "parameters": parameters,
        "batch": batch, "seq": seq, "layers": layers, "steps": steps,
        "peak_allocated": stats.map(|s| s.peak.allocated),
        "peak_reserved": stats.map(|s| s.peak.reserved),
        // Bytes asked for, before the allocator's rounding and block slack.
        "peak_requested": stats.map(|s| s.peak.requested),
        "step_seconds": times,
        "median_step_seconds": sorted.get(sorted.len() / 2),
        "losses": losses,
        "optimizer_state_bytes": state_bytes,
        "phases": phases.0,
        "history": history,
        "timeline": timeline,
    })
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut steps, mut batch, mut seq, mut layers) = (6usize, 16i64, 1024i64, 13i64);
    let mut configs = Vec::new();
    while let Some(arg) = args.next() {
        let mut value = || {
            args.next()
                .expect("a value after the flag")
                .parse::<i64>()
                .unwrap()
        };
        match arg.as_str() {
            "--steps" => steps = value() as usize,
            "--batch" => batch = value(),
            "--seq" => seq = value(),
            "--layers" => layers = value(),
            name => configs.push(name.to_string()),
        }
    }
    if configs.is_empty() {
        configs = [
            "plain",
            "checkpoint",
            "bf16",
            "f16",
            "accumulate4",
            "sgd",
            "lion",
            "adamw8bit",
            "adafactor",
            "combined",
        ]
        .map(String::from)
        .to_vec();
    }
    let device = Device::cuda_if_available();
    for name in configs {
        let result = run(&name, steps, batch, seq, layers, device);
        println!("{result}");
        let _ = tchmem::cuda_stats::empty_cache();
    }
}
