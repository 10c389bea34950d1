//! What the live view and the interruptible loops cost a training step, on the GPU (H200):
//!
//!     live_bench [--rounds N] [--steps N] [--batch B] [--layers L]
//!
//! Runs the GPT benchmark model (`gpt_bench`'s plain fp32 AdamW loop) without and with what the
//! kernel adds to a long cell, alternating in one process: the check at the start of each loop
//! body (the step loop and the micro-batch loop, as the kernel inserts them), and a thread that
//! does the child's sampling four times a second (the allocator's counters through the runtime's
//! hook, the loops' counts, the sample written as one JSON line). Prints each mode's median step
//! time and the ratio (goal: the view costs at most 1% of a step).

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tch::Device;
use tchmem_wire::progress::LiveSample;
use tchmem_wire::CellMessage;

#[allow(dead_code)]
#[path = "gpt_bench.rs"]
mod bench;

/// The child's sampling (src/child/live.rs) on a thread until `stop`; returns the samples sent.
fn sample_until(stop: Arc<AtomicBool>) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut sink = std::fs::File::create("/dev/null").unwrap();
        let started = Instant::now();
        let mut sent = 0;
        while !stop.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(250));
            let sample = LiveSample {
                elapsed: started.elapsed().as_secs_f64(),
                memory: tchmem::hooks::memory_now(),
                progress: tchmem::progress::snapshot(),
            };
            writeln!(sink, "{}", CellMessage::Live(sample).to_line()).unwrap();
            sent += 1;
        }
        sent
    })
}

fn main() {
    let (rounds, steps, batch, layers) =
        bench::mode_flags(std::env::args().skip(1), (3, 20, 16, 13));
    tchmem::record::measure_context();
    let modes = ["off", "live"];
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    for round in 0..rounds {
        for (i, mode) in modes.iter().enumerate() {
            let stop = Arc::new(AtomicBool::new(false));
            let sampler = if *mode == "live" {
                std::env::set_var("GPT_BENCH_LIVE", "1");
                Some(sample_until(Arc::clone(&stop)))
            } else {
                std::env::remove_var("GPT_BENCH_LIVE");
                None
            };
            let result = bench::run("plain", steps, batch, 1024, layers, Device::Cuda(0));
            stop.store(true, Ordering::SeqCst);
            let samples = sampler.map(|s| s.join().unwrap());
            let step_times: Vec<f64> =
                serde_json::from_value(result["step_seconds"].clone()).unwrap();
            // The first step of each run creates AdamW's state: left out, as gpt_bench does.
            times[i].extend_from_slice(&step_times[1..]);
            println!(
                "{{\"round\": {round}, \"mode\": \"{mode}\", \"median_step_seconds\": {}, \"samples\": {}}}",
                result["median_step_seconds"],
                samples.map_or("null".to_string(), |n| n.to_string())
            );
            let _ = tchmem::cuda_stats::empty_cache();
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let base = median(&mut times[0]);
    println!(
        "mode  median step (ms)  ratio  (GPT {layers} layers, batch {batch}x1024, {rounds} rounds x {} steps)",
        steps - 1
    );
    for (i, mode) in modes.iter().enumerate() {
        let m = median(&mut times[i]);
        println!("{mode:<5} {:>16.2}  {:.4}x", m * 1e3, m / base);
    }
}
