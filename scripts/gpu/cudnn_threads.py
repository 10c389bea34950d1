"""Which workspace a convolution's backward takes under cuDNN's benchmark mode, by thread (issue #20).

cifar_resnet_benchmark at micro-batch 32 was +13.5%: one convolution's backward (256 -> 512
channels, 8x8, 3x3), replayed alone by the kernel, took an 11.0 MB workspace where the loop
took 33.0 MB, although the loop had run at 32 before the replay. PyTorch keeps cuDNN v8's
benchmark cache per thread (`_get_benchmark_cache`, thread_local), times each candidate once
(`CUDNN_FIND_SAMPLE_ONCE`), and a loop's backward runs on autograd's device thread, while a
replay calls the operator from the caller's thread. This probe, in fresh processes, measures
the excess over what was allocated (outputs and workspaces) of that backward:

- `autograd`: as the loop runs it, `y.backward(g)` (autograd's device thread);
- `caller`: `aten::convolution_backward` called from the main thread, as the replay does,
  after the autograd run (same shapes, so a shared cache would hand the same plan back);
- `fresh_thread`: the same call from a new Python thread (a new, empty cache);

with random and with zero-filled tensors (the replay's are zeros).

Usage: python cudnn_threads.py OUT.json [--processes 8] [--batches 8,16,32]
"""

import argparse
import json
import subprocess
import sys
import threading

import torch


def excess(run):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    keep = run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del keep
    return peak - base


def tensors(batch, zeros):
    make = torch.zeros if zeros else torch.randn
    x = make(batch, 256, 8, 8, device="cuda")
    w = make(512, 256, 3, 3, device="cuda")
    g = make(batch, 512, 8, 8, device="cuda")
    return x, w, g


def direct(x, w, g):
    return torch.ops.aten.convolution_backward(
        g, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, False]
    )


def through_autograd(x, w, g):
    xr = x.clone().requires_grad_(True)
    wr = w.clone().requires_grad_(True)
    y = torch.nn.functional.conv2d(xr, wr, padding=1)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y.backward(g)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def on_new_thread(x, w, g):
    out = {}

    def body():
        excess(lambda: direct(x, w, g))  # benchmarks in this thread's empty cache
        out["excess"] = excess(lambda: direct(x, w, g))

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out["excess"]


def one_process(batches):
    torch.backends.cudnn.benchmark = True
    rows = []
    for zeros in (False, True):
        for batch in batches:
            x, w, g = tensors(batch, zeros)
            through_autograd(x, w, g)  # benchmarks on autograd's thread
            row = {"batch": batch, "zeros": zeros, "autograd": through_autograd(x, w, g)}
            excess(lambda: direct(x, w, g))
            row["caller"] = excess(lambda: direct(x, w, g))
            row["fresh_thread"] = on_new_thread(x, w, g)
            rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--batches", default="8,16,32")
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        print(json.dumps(one_process(batches)))
        return
    result = {
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "device": torch.cuda.get_device_name(0),
        "benchmark_limit": torch.backends.cudnn.benchmark_limit,
        "processes": [],
    }
    for _ in range(args.processes):
        out = subprocess.run(
            [sys.executable, __file__, "-", "--child", "--batches", args.batches],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        rows = json.loads(out.strip().splitlines()[-1])
        result["processes"].append(rows)
        for r in rows:
            print(
                f"batch {r['batch']:3d} zeros {r['zeros']!s:5}: autograd {r['autograd'] / 1e6:7.2f} MB"
                f"  caller {r['caller'] / 1e6:7.2f}  fresh thread {r['fresh_thread'] / 1e6:7.2f}",
                flush=True,
            )
        print("--", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
