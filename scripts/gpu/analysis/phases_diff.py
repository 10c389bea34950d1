"""Where ours and PyTorch's memory first differ, from runs with GPT_BENCH_PHASES=1: for each
configuration, allocated and peak bytes at each marked point (model, data, reset, then forward,
backward and step of every micro-batch and step), ours minus PyTorch's.

    python3 phases_diff.py gpt-tch.jsonl gpt-pytorch.jsonl
"""

import json
import sys


def load(path):
    return {r["config"]: r for r in map(json.loads, (l for l in open(path) if l.startswith("{")))
            if r.get("phases")}


def main(ours_path, theirs_path):
    ours, theirs = load(ours_path), load(theirs_path)
    for name, run in ours.items():
        other = theirs.get(name)
        if not other:
            continue
        print(f"{name}: point, allocated Δ KiB, peak Δ KiB (ours − PyTorch)")
        for (point, alloc, peak), (point2, alloc2, peak2) in zip(run["phases"], other["phases"]):
            flag = "" if point == point2 else f"  (PyTorch's point: {point2})"
            print(f"  {point:9} {(alloc - alloc2) / 1024:+10.1f} {(peak - peak2) / 1024:+10.1f}{flag}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
