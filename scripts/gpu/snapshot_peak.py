"""Which blocks are live at the peak of one GPT benchmark configuration, ours and PyTorch's, and
how the two differ, from the CUDA caching allocator's own memory history.

Ours runs in this same Python process: gpt_bench_lib (runtime/examples/gpt_bench_lib.rs, built on
the CPU machine) is loaded with ctypes and allocates through the same libtorch allocator, so
torch.cuda.memory._record_memory_history sees both frameworks the same way.

    python snapshot_peak.py --lib .gpu/bin/libgpt_bench_lib.so --config bf16 --steps 3 [--stacks]

Runs one framework per process (a fresh allocator each): call it with --framework tch and
--framework pytorch, writing JSON with --out, then --diff A.json B.json prints the difference.
"""

import argparse
import collections
import ctypes
import json
import sys


def live_at_peak(trace):
    """The allocator's peak of allocated bytes over `trace` and the blocks live at it."""
    live, total, peak, peak_index = {}, 0, 0, -1
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], i)
            total += event["size"]
            if total > peak:
                peak, peak_index = total, i
        elif event["action"] == "free_completed":
            if event["addr"] in live:
                total -= live.pop(event["addr"])[0]
    # Second pass to the peak event: cheaper than copying the live set at every new maximum.
    live = {}
    for i, event in enumerate(trace[: peak_index + 1]):
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], i)
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    return peak, peak_index, live


def frames_text(event, limit=12):
    frames = event.get("frames") or []
    names = [f"{f.get('name', '?')} ({f.get('filename', '')}:{f.get('line', '')})" for f in frames]
    interesting = [n for n in names if "c10::cuda" not in n and "CUDACachingAllocator" not in n]
    return interesting[:limit]


def record(args):
    import torch

    torch.cuda.init()
    torch.cuda.memory._record_memory_history(
        max_entries=3_000_000, stacks="all" if args.stacks else "python")
    if args.framework == "tch":
        lib = ctypes.CDLL(args.lib)
        status = lib.tchmem_gpt_bench(args.config.encode(), args.steps)
        if status != 0:
            sys.exit(f"gpt_bench_lib failed on {args.config}")
    else:
        sys.path.insert(0, "scripts/gpu")
        import bench_pytorch
        print(json.dumps(bench_pytorch.run(args.config, args.steps, 16, 1024, 13)))
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    trace = snapshot["device_traces"][0]
    peak, index, live = live_at_peak(trace)
    blocks = [
        {"size": size, "event": i, "frames": frames_text(trace[i]) if args.stacks else []}
        for size, i in sorted(live.values(), key=lambda b: b[1])
    ]
    out = {"framework": args.framework, "config": args.config, "steps": args.steps,
           "events": len(trace), "peak_event": index, "peak_from_trace": peak,
           "max_memory_allocated": torch.cuda.max_memory_allocated(),
           "live_blocks": blocks}
    with open(args.out, "w") as f:
        json.dump(out, f)
    print(f"{args.framework} {args.config}: {len(trace)} events, peak {peak} at event {index} "
          f"(allocator's max_memory_allocated {torch.cuda.max_memory_allocated()}), "
          f"{len(blocks)} live blocks", file=sys.stderr)


def diff(a_path, b_path):
    a, b = json.load(open(a_path)), json.load(open(b_path))
    print(f"{a['framework']} peak {a['peak_from_trace']} ({len(a['live_blocks'])} blocks) vs "
          f"{b['framework']} peak {b['peak_from_trace']} ({len(b['live_blocks'])} blocks): "
          f"{(a['peak_from_trace'] - b['peak_from_trace']) / 2**20:+.3f} MiB")
    sizes_a = collections.Counter(x["size"] for x in a["live_blocks"])
    sizes_b = collections.Counter(x["size"] for x in b["live_blocks"])
    print("block sizes live at the peak in one and not the other (size: count difference):")
    for size in sorted(set(sizes_a) | set(sizes_b)):
        d = sizes_a[size] - sizes_b[size]
        if d:
            print(f"  {size} B ({size / 2**20:.3f} MiB): {d:+d} ({a['framework']} {sizes_a[size]}, {b['framework']} {sizes_b[size]})")
    for name, run, other in ((a["framework"], a, sizes_b), (b["framework"], b, sizes_a)):
        extra = collections.Counter(x["size"] for x in run["live_blocks"]) - other
        shown = 0
        for block in run["live_blocks"]:
            if extra[block["size"]] > 0 and shown < 12:
                extra[block["size"]] -= 1
                shown += 1
                print(f"{name}: extra block {block['size']} B allocated at event {block['event']} "
                      f"(peak at {run['peak_event']})")
                for frame in block["frames"]:
                    print(f"      {frame}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", choices=["tch", "pytorch"])
    parser.add_argument("--lib", default=".gpu/bin/libgpt_bench_lib.so")
    parser.add_argument("--config", default="bf16")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--stacks", action="store_true", help="record C++ stacks (slow)")
    parser.add_argument("--out")
    parser.add_argument("--diff", nargs=2, metavar=("A", "B"))
    args = parser.parse_args()
    if args.diff:
        diff(*args.diff)
    else:
        record(args)


if __name__ == "__main__":
    main()
