"""Prototype of a peak estimate from per-op measurement (issue #20), checked against the truth.

Two calibration trials (a quarter and a half of the target batch) record, for every ATen op of
the third training step, the bytes allocated when it starts and how far above that it goes while
it runs. Ops line up across the trials (same model, same order). At the target batch:

    peak = max over ops i of  start_i(B) + excess_i(B)

start_i is a line through the two trials (the tensors alive grow with the batch); excess_i is a
line too, except for ops whose excess is large: those are run alone at the target's shapes (the
tensor arguments' batch dimension scaled) and their excess measured, which catches a workspace
that cuDNN sizes by another algorithm at that shape. Compared with a trial at the target batch,
and with the line through the two trials' peaks (what %memestimate does today).

Usage: python op_replay_probe.py OUT.json [--model resnet18|vgg] [--amp] [--targets 256,512]
"""

import argparse
import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from conv_peaks import ResNet18

MiB = 2**20


def vgg():
    layers, cin = [], 3
    for cout in [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M"]:
        if cout == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(cin, cout, 3, 1, 1), nn.BatchNorm2d(cout), nn.ReLU()]
            cin = cout
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(512 * 4 * 4, 1024), nn.ReLU(), nn.Dropout(0.5), nn.Linear(1024, 10))


class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = func(*args, **kwargs)
        peak = torch.cuda.max_memory_allocated()
        describe = lambda a: ("T", tuple(a.shape), str(a.dtype), a.stride(), a.device.type) if isinstance(a, torch.Tensor) else a
        self.ops.append(
            {
                "name": str(func),
                "start": start,
                "excess": peak - start,
                "func": func,
                "args": tree_map(describe, args),
                "kwargs": tree_map(describe, kwargs),
            }
        )
        return out


def trial(make, batch, amp, steps=3):
    torch.manual_seed(0)
    model = make().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=False)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    recorder = None
    peak = 0
    for s in range(steps):
        x = torch.rand(batch, 3, 64, 64, device="cuda")
        y = torch.randint(10, (batch,), device="cuda")
        last = s == steps - 1
        torch.cuda.reset_peak_memory_stats()
        if last:
            recorder = Recorder()
            recorder.__enter__()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        if last:
            recorder.__exit__(None, None, None)
        else:
            peak = max(peak, torch.cuda.max_memory_allocated())
        del x, y, loss
    torch.cuda.synchronize()
    del model, opt
    torch.cuda.empty_cache()
    return peak, recorder.ops


def scale_dims(shape1, shape2, b1, b2, target):
    out = []
    for d1, d2 in zip(shape1, shape2):
        if d1 != d2 and d1 * b2 == d2 * b1:
            out.append(d1 * target // b1)
        else:
            out.append(d1)
    return tuple(out)


def replay(op1, op2, b1, b2, target):
    made = []

    def build(a1, a2):
        if isinstance(a1, tuple) and len(a1) == 5 and a1[0] == "T":
            shape = scale_dims(a1[1], a2[1], b1, b2, target)
            dtype = getattr(torch, a1[2].replace("torch.", ""))
            t = torch.zeros(shape, dtype=dtype, device=a1[4])
            made.append(t)
            return t
        if isinstance(a1, (list, tuple)) and isinstance(a2, (list, tuple)) and len(a1) == len(a2):
            return type(a1)(build(x, y) for x, y in zip(a1, a2))
        if isinstance(a1, int) and isinstance(a2, int) and a1 != a2 and a1 * b2 == a2 * b1:
            return a1 * target // b1
        return a1

    args = build(op1["args"], op2["args"])
    kwargs = {k: build(v, op2["kwargs"][k]) for k, v in op1["kwargs"].items()}
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = op1["func"](*args, **kwargs)
    excess = torch.cuda.max_memory_allocated() - start
    del out, args, kwargs, made
    torch.cuda.empty_cache()
    return excess


def line(b1, v1, b2, v2, b):
    return v1 + (v2 - v1) * (b - b1) / (b2 - b1)


def estimate(make, target, amp, replay_share):
    b1, b2 = target // 4, target // 2
    p1, ops1 = trial(make, b1, amp)
    p2, ops2 = trial(make, b2, amp)
    assert [o["name"] for o in ops1] == [o["name"] for o in ops2], "ops differ"
    plain = line(b1, p1, b2, p2, target)
    starts = [line(b1, o1["start"], b2, o2["start"], target) for o1, o2 in zip(ops1, ops2)]
    excesses = [max(0.0, line(b1, o1["excess"], b2, o2["excess"], target)) for o1, o2 in zip(ops1, ops2)]
    # Replay the ops whose excess is a share of the peak worth checking.
    replayed, cache = 0, {}
    for i, (o1, o2) in enumerate(zip(ops1, ops2)):
        if max(o1["excess"], o2["excess"], excesses[i]) >= replay_share * plain:
            key = (o1["name"], repr(o1["args"]), repr(o2["args"]))
            if key not in cache:
                cache[key] = replay(o1, o2, b1, b2, target)
                replayed += 1
            excesses[i] = cache[key]
    linear_only = max(s + line(b1, o1["excess"], b2, o2["excess"], target) for s, o1, o2 in zip(starts, ops1, ops2))
    by_ops = max(s + e for s, e in zip(starts, excesses))
    truth, _ = trial(make, target, amp)
    return {
        "target": target,
        "amp": amp,
        "calibration": [b1, b2],
        "calibration_peaks": [p1, p2],
        "truth": truth,
        "line_of_peaks": plain,
        "ops_linear": linear_only,
        "ops_replayed": by_ops,
        "ops": len(ops1),
        "replayed": replayed,
        "backward_ops": sum("backward" in o["name"] for o in ops1),
        "top_replays": sorted(((k[0], v) for k, v in cache.items()), key=lambda kv: -kv[1])[:6],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--amp", action="store_true")
    ap.add_argument("--targets", default="256,512")
    ap.add_argument("--share", type=float, default=0.01)
    args = ap.parse_args()
    make = {"resnet18": lambda: ResNet18(10), "vgg": vgg}[args.model]
    results = []
    for t in args.targets.split(","):
        r = estimate(make, int(t), args.amp, args.share)
        r["model"] = args.model
        results.append(r)
        err = lambda v: "%+.1f%%" % (100 * (v / r["truth"] - 1))
        print(
            args.model, "amp" if args.amp else "fp32", t,
            "truth %.1f MiB" % (r["truth"] / MiB),
            "line-of-peaks", err(r["line_of_peaks"]),
            "ops-linear", err(r["ops_linear"]),
            "ops-replayed", err(r["ops_replayed"]),
            "(%d ops, %d backward, %d replayed)" % (r["ops"], r["backward_ops"], r["replayed"]),
            file=sys.stderr,
        )
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
