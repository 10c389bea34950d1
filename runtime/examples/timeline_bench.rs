//! Allocation timelines on the GPU (H200), two jobs:
//!
//!     timeline_bench fixture DIR     # small GPT, 2 steps: DIR/{trace,stacks}.{pickle,json}
//!     timeline_bench overhead [--rounds N] [--steps N] [--batch B] [--layers L]
//!
//! `fixture` records the traces the kernel's CI tests render (the capture JSON is what the
//! runtime hands the kernel after a `%%memprofile` cell). `overhead` runs the GPT benchmark
//! model (`gpt_bench`'s plain fp32 AdamW loop) with the phase markers and no recording, with
//! the allocation history, and with the history and C++ stacks, alternating in one process, and
//! prints each mode's median step time and its ratio to no recording.

use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[allow(dead_code)]
#[path = "gpt_bench.rs"]
mod bench;

fn fixture(dir: &str) {
    std::fs::create_dir_all(dir).unwrap();
    let device = Device::Cuda(0);
    tchmem::record::measure_context();
    tch::manual_seed(0);
    let vs = nn::VarStore::new(device);
    let model = bench::Gpt::new(&vs, 2, 256, false);
    tchmem::watch(&vs);
    let mut opt = nn::AdamW::default().build(&vs, 3e-4).unwrap();
    for (name, stacks) in [("trace", false), ("stacks", true)] {
        let snapshot = format!("{dir}/{name}.pickle");
        tchmem::timeline::begin(tchmem::timeline::Request {
            snapshot,
            stacks,
            max_entries: 1_000_000,
            steps: None,
        })
        .expect("allocation history");
        for _ in 0..2 {
            tchmem::phase::data();
            let idx = Tensor::randint(bench::VOCAB, [4, 256], (Kind::Int64, device));
            let targets = Tensor::randint(bench::VOCAB, [4, 256], (Kind::Int64, device));
            tchmem::watch_batch(&idx);
            let loss = tchmem::phase::train_step(&mut opt, || model.loss(&idx, &targets));
            let _ = loss.double_value(&[]);
        }
        let capture = tchmem::timeline::finish().unwrap();
        assert!(capture.error.is_none(), "{:?}", capture.error);
        std::fs::write(
            format!("{dir}/{name}.json"),
            serde_json::to_string_pretty(&capture).unwrap(),
        )
        .unwrap();
        println!(
            "{name}: {} bytes of snapshot, {} phase marks, {} steps",
            std::fs::metadata(&capture.snapshot).unwrap().len(),
            capture.phases.len(),
            capture.steps
        );
    }
}

fn overhead(mut args: impl Iterator<Item = String>) {
    let (rounds, steps, batch, layers) = bench::mode_flags(&mut args, (3, 8, 16, 13));
    let modes = ["markers", "trace", "stacks"];
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    for round in 0..rounds {
        for (i, mode) in modes.iter().enumerate() {
            std::env::set_var("GPT_BENCH_HISTORY", mode);
            let result = bench::run("plain", steps, batch, 1024, layers, Device::Cuda(0));
            let step_times: Vec<f64> =
                serde_json::from_value(result["step_seconds"].clone()).unwrap();
            // The first step of each run creates AdamW's state: left out, as gpt_bench does.
            times[i].extend_from_slice(&step_times[1..]);
            println!(
                "{{\"round\": {round}, \"mode\": \"{mode}\", \"median_step_seconds\": {}, \"timeline\": {}}}",
                result["median_step_seconds"], result["timeline"]
            );
            let _ = tchmem::cuda_stats::empty_cache();
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let base = median(&mut times[0]);
    println!("mode      median step (ms)  ratio  (GPT {layers} layers, batch {batch}x1024, {rounds} rounds x {} steps)", steps - 1);
    for (i, mode) in modes.iter().enumerate() {
        let m = median(&mut times[i]);
        println!("{mode:<9} {:>16.2}  {:.3}x", m * 1e3, m / base);
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    match args.next().as_deref() {
        Some("fixture") => fixture(&args.next().expect("an output directory")),
        Some("overhead") => overhead(args),
        _ => eprintln!("usage: timeline_bench fixture DIR | timeline_bench overhead [--rounds N] [--steps N] [--batch B] [--layers L]"),
    }
}
