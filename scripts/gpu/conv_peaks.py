"""What a conv net's training peak is made of, batch by batch (issue #20).

tch::vision's resnet18 (the same layers and order, written here in PyTorch, which runs the same
ATen kernels) trained with SGD + momentum on 64x64 images, as the corpus's resnet18 notebook on
the H200. For each batch: three steps from an emptied cache, as `%memestimate`'s trials run
them, with the allocator's history recorded (C++ stacks), then

- peak allocated / reserved, allocated at the end of each forward and backward;
- the blocks alive at the peak, by what allocated them (cuDNN workspace, saved activations,
  gradients, ...), summed;
- every transient block (freed within the op that made it) over 1 MiB, by kind.

Usage: python conv_peaks.py OUT.json [--batches 32,64,128,256,512] [--amp] [--benchmark]
"""

import argparse
import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


def conv_bn(cin, cout, k, s, p):
    return nn.Sequential(nn.Conv2d(cin, cout, k, s, p, bias=False), nn.BatchNorm2d(cout))


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = conv_bn(cin, cout, 3, stride, 1)
        self.c2 = conv_bn(cout, cout, 3, 1, 1)
        self.down = conv_bn(cin, cout, 1, stride, 0) if stride != 1 or cin != cout else None

    def forward(self, x):
        y = F.relu(self.c1(x))
        y = self.c2(y)
        return F.relu(y + (self.down(x) if self.down is not None else x))


class ResNet18(nn.Module):
    def __init__(self, classes):
        super().__init__()
        self.stem = conv_bn(3, 64, 7, 2, 3)
        layers, cin = [], 64
        for cout, stride in [(64, 1), (128, 2), (256, 2), (512, 2)]:
            layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.stem(x)), 3, 2, 1)
        x = self.layers(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, (1, 1)), 1))


def kind_of(frames):
    """What allocated a block, from its C++/Python frames."""
    names = [f.get("name", "") for f in frames or []]
    text = " ".join(names)
    if "Workspace" in text or "workspace" in text:
        return "cudnn-workspace" if "cudnn" in text.lower() else "workspace"
    if "cublas" in text.lower():
        return "cublas"
    for name in names:
        for key in (
            "max_pool2d_with_indices_backward",
            "max_pool2d_with_indices",
            "native_batch_norm_backward",
            "batch_norm_backward",
            "cudnn_batch_norm_backward",
            "cudnn_batch_norm",
            "native_batch_norm",
            "convolution_backward",
            "cudnn_convolution",
            "_convolution",
            "threshold_backward",
            "relu",
            "addmm",
            "mm",
            "add",
            "mul",
            "_foreach",
            "sgd",
            "copy_",
            "accumulate",
            "AccumulateGrad",
            "empty",
        ):
            if key in name:
                return key
    return "other"


def analyse(snapshot, begin_allocated):
    trace = snapshot["device_traces"][0]
    live, allocated, peak, peak_at = {}, begin_allocated, begin_allocated, -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], i)
            allocated += e["size"]
            if allocated > peak:
                peak, peak_at = allocated, i
        elif e["action"] == "free_completed" and e["addr"] in live:
            allocated -= live.pop(e["addr"])[0]
    # Replay to the peak: the blocks alive there.
    live = {}
    for i, e in enumerate(trace[: peak_at + 1]):
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], i)
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    at_peak = {}
    for size, i in live.values():
        k = kind_of(trace[i].get("frames"))
        at_peak[k] = at_peak.get(k, 0) + size
    # Transient blocks: lifetimes, by kind, the largest of each.
    born = {}
    transient = {}
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            born[e["addr"]] = i
        elif e["action"] == "free_completed" and e["addr"] in born:
            j = born.pop(e["addr"])
            if e["size"] >= 1 << 20 and i - j < 40:
                k = kind_of(trace[j].get("frames"))
                transient.setdefault(k, []).append(e["size"])
    transient = {k: {"count": len(v), "max": max(v), "sizes": sorted(set(v))[-8:]} for k, v in transient.items()}
    return {
        "trace_peak_allocated": peak,
        "at_peak_by_kind": dict(sorted(at_peak.items(), key=lambda kv: -kv[1])),
        "peak_kind": kind_of(trace[peak_at].get("frames")) if peak_at >= 0 else None,
        "peak_block_size": trace[peak_at]["size"] if peak_at >= 0 else None,
        "transient": transient,
        "segments": [
            (e["action"], e["size"]) for e in trace if e["action"].startswith("segment")
        ],
    }


def run(batch, amp, steps=3):
    torch.manual_seed(0)
    model = ResNet18(10).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=False)
    data = torch.rand(batch * steps, 3, 64, 64)
    labels = torch.randint(10, (batch * steps,))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    begin = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="all", context="all")
    phases = []
    for s in range(steps):
        x = data[s * batch : (s + 1) * batch].cuda()
        y = labels[s * batch : (s + 1) * batch].cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(model(x), y)
        torch.cuda.synchronize()
        after_forward = torch.cuda.memory_allocated()
        opt.zero_grad(set_to_none=True) if s == 0 else None
        loss.backward()
        torch.cuda.synchronize()
        after_backward = torch.cuda.memory_allocated()
        opt.step()
        opt.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        phases.append(
            {
                "after_forward": after_forward,
                "after_backward": after_backward,
                "after_step": torch.cuda.memory_allocated(),
            }
        )
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    result = {
        "batch": batch,
        "amp": amp,
        "begin_allocated": begin,
        "parameters": params,
        "buffers": buffers,
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "peak_reserved": torch.cuda.max_memory_reserved(),
        "phases": phases,
    }
    result.update(analyse(snapshot, begin))
    del model, opt, data, labels
    torch.cuda.empty_cache()
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--batches", default="32,64,128,256,512")
    ap.add_argument("--amp", action="store_true")
    ap.add_argument("--benchmark", action="store_true")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = args.benchmark
    results = [run(int(b), args.amp) for b in args.batches.split(",")]
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    for r in results:
        print(
            r["batch"],
            "amp" if r["amp"] else "fp32",
            "peak_alloc %.1f MiB reserved %.1f MiB" % (r["peak_allocated"] / 2**20, r["peak_reserved"] / 2**20),
            "at peak:",
            {k: round(v / 2**20, 1) for k, v in r["at_peak_by_kind"].items()},
            "peak op:", r["peak_kind"], round(r["peak_block_size"] / 2**20, 1),
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
