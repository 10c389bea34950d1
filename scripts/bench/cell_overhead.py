"""Per-cell cost of memory recording: the same cells in a recording kernel and in one with
TCHMEM_RECORD=0, alternating, timed from the client; plus the hooks' own time from the child."""

import os
import statistics
import subprocess
import sys
import time

from jupyter_client.manager import start_new_kernel

RECORD_MIME = "application/vnd.tchmem.record+json"
SETUP = """
use tch::nn::{self, Module};
let bench_device: tch::Device = tch::Device::cuda_if_available();
let bench_vs: nn::VarStore = nn::VarStore::new(bench_device);
let bench_model: nn::Linear = nn::linear(bench_vs.root(), 1024, 1024, Default::default());
let bench_x: tch::Tensor = tch::Tensor::randn([64, 1024], (tch::Kind::Float, bench_device));
"""
# A cell that allocates, frees and reads back, like a small step of real work.
CELL = "bench_model.forward(&bench_x).relu().sum(tch::Kind::Float).double_value(&[]) > {i}.0"


def run(kc, code, timeout=900):
    """Executes `code`; returns (seconds from request to idle, iopub messages)."""
    start = time.perf_counter()
    msg_id = kc.execute(code)
    messages = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        messages.append(msg)
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    elapsed = time.perf_counter() - start
    reply = kc.get_shell_msg(timeout=timeout)
    if reply["content"]["status"] != "ok":
        sys.exit(f"cell failed: {reply['content']}")
    return elapsed, messages


def recording_seconds(messages):
    for msg in messages:
        data = msg["content"].get("data", {})
        if RECORD_MIME in data:
            return data[RECORD_MIME].get("recording_seconds")
    return None


def main(cells):
    kernels = {}
    for name, record in (("recording", "1"), ("not recording", "0")):
        env = dict(os.environ, TCHMEM_RECORD=record)
        km, kc = start_new_kernel(kernel_name="tchmem", env=env, startup_timeout=120,
                                  stderr=subprocess.DEVNULL)
        run(kc, "%memprofile always")
        run(kc, SETUP)
        kernels[name] = (km, kc)
    times = {name: [] for name in kernels}
    hooks = []
    for i in range(cells):
        for name, (_, kc) in kernels.items():
            elapsed, messages = run(kc, CELL.format(i=i))
            times[name].append(elapsed)
            if name == "recording":
                seconds = recording_seconds(messages)
                if seconds is None:
                    sys.exit("the recording kernel showed no record")
                hooks.append(seconds)
    for km, kc in kernels.values():
        kc.stop_channels()
        km.shutdown_kernel(now=True)

    on = statistics.median(times["recording"]) * 1000
    off = statistics.median(times["not recording"]) * 1000
    print(f"{cells} cells per kernel (median ms per cell, end to end: compile + run + reply)")
    print(f"{'recording':>16} {'not recording':>14} {'difference':>11} {'in the hooks':>13}")
    print(f"{on:16.1f} {off:14.1f} {on - off:11.1f} {statistics.median(hooks) * 1000:13.3f}")
    print(f"hooks: min {min(hooks) * 1000:.3f} ms, max {max(hooks) * 1000:.3f} ms (goal: <= 5 ms)")


if __name__ == "__main__":
    main(int(sys.argv[1]))
