"""Benchmark: drawing an allocation timeline of N synthetic trace entries (default 1,000,000).

Writes a capture and a snapshot pickle shaped like libtorch's (training steps: a forward pass
allocating activations, a backward pass freeing them and making gradients, an optimizer step),
then runs `tchmem timeline` on it and prints what it reports: the time to read the pickle, the
time to build and draw the timeline, and the SVG's size (goals: < 1 s and < 500 KB to draw)."""

import json
import os
import pickle
import subprocess
import sys
import tempfile
import time

MIB = 1 << 20


def synthetic(entries: int):
    trace, phases = [], []
    t = 1_796_000_000_000_000  # µs since the epoch, as libtorch's trace has them
    address = 0x7F00_0000_0000
    live = []
    step = 0
    while len(trace) < entries:
        phases.append({"phase": "forward", "time_us": t})
        for layer in range(50):
            address += 64 * MIB
            live.append(address)
            trace.append({"action": "alloc", "addr": address, "size": 64 * MIB, "stream": 0,
                          "time_us": t, "frames": [], "user_metadata": "tchmem:forward"})
            t += 10
        phases.append({"phase": "backward", "time_us": t})
        while live:
            a = live.pop()
            trace.append({"action": "free_requested", "addr": a, "size": 64 * MIB, "stream": 0,
                          "time_us": t, "frames": [], "user_metadata": ""})
            trace.append({"action": "free_completed", "addr": a, "size": 64 * MIB, "stream": 0,
                          "time_us": t, "frames": [], "user_metadata": ""})
            t += 10
        phases.append({"phase": "step", "time_us": t})
        t += 100
        phases.append({"phase": "other", "time_us": t})
        step += 1
    trace = trace[:entries]
    snapshot = {"segments": [], "device_traces": [trace], "allocator_settings": {},
                "external_annotations": []}
    capture = {"snapshot": "", "stacks": False, "max_entries": entries + 1,
               "started_us": trace[0]["time_us"], "ended_us": t,
               "at_start": {"allocated": 0, "reserved": 0, "active": 0, "requested": 0},
               "start_categories": [], "storages_at_start": [], "storages_at_end": [],
               "phases": phases, "steps": step, "stopped_after_steps": None, "error": None}
    return snapshot, capture


def main():
    entries = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    tchmem = os.environ["TCHMEM_BIN"]
    with tempfile.TemporaryDirectory() as tmp:
        began = time.perf_counter()
        snapshot, capture = synthetic(entries)
        capture_path = os.path.join(tmp, "bench.json")
        with open(os.path.join(tmp, "bench.pickle"), "wb") as f:
            pickle.dump(snapshot, f, protocol=2)
        capture["snapshot"] = os.path.join(tmp, "bench.pickle")
        with open(capture_path, "w") as f:
            json.dump(capture, f)
        size = os.path.getsize(capture["snapshot"])
        print(f"wrote {entries:,} trace entries ({size / MIB:.1f} MiB of pickle) in "
              f"{time.perf_counter() - began:.1f} s")
        svg = os.path.join(tmp, "bench.svg")
        done = subprocess.run([tchmem, "timeline", capture_path, "-o", svg],
                              capture_output=True, text=True, check=True)
        print(done.stderr.strip())
        print(f"SVG: {os.path.getsize(svg) / 1024:.0f} KiB (goal < 500 KB)")


main()
