"""The caching allocator's own events of training trials, batch by batch (issue #20).

For the reserved-memory estimate: every alloc, free and segment event of a trial (`%memestimate`'s
calibration trials run four steps from an emptied cache; this runs the same on the same ATen
kernels), with the segments held at the trial's start and the allocator's measured peaks. The
kernel's estimate replays such events through its model of the allocator (src/fit/allocator.rs);
these traces are what that model is checked against (reserved measured here vs simulated there).

Models: tch::vision's resnet18 on 64x64 images with SGD + momentum (`conv_peaks.py`), the corpus's
VGG-style net with BatchNorm and AdamW on 64x64, and its GRU (embedding 32, hidden 1024, 256
steps, 65 tokens, Adam, gradients clipped) at the sizes `corpus-notebooks --estimates` writes.

With `--accumulate K` each step runs as `%%optimize --accumulate K` rewrites it: `zero_grad`,
then K micro-batches' forward and backward (each loss weighted by its share), then the step.

Usage: python alloc_traces.py OUT_DIR [--models resnet18,vgg,gru] [--steps 4] [--passes 2]
       [--amp] [--vgg-widths 64,128,256,512] [--cudnn-benchmark] [--accumulate K]
       [--batches 64,128,256]
Writes OUT_DIR/<model>[-bf16][-accK]-<batch>-<pass>.json: {"batch", "accumulate",
"parameters": [[dims, element_size], ...] (the trainable ones), "step_begins": the index in
"events" where the last step begins, "begin": {"allocated", "reserved",
"segments": [[address, total_size, [[block_size, allocated], ...]], ...]}, "events": [[action,
address, size], ...] (action: a alloc, f free completed, s segment alloc, S segment free),
"peak_allocated", "peak_reserved", "stats": the allocator's retries, OOMs, device allocs and
frees during the trial, "ooms": the sizes of requests it could not serve (o in "events")}.
"""

import argparse
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from conv_peaks import ResNet18

ACTIONS = {"alloc": "a", "free_completed": "f", "segment_alloc": "s", "segment_free": "S", "oom": "o"}
# What the allocator did beyond serving requests: a request it could not serve at once frees its
# cache and retries (num_alloc_retries), or fails (num_ooms) where the caller may catch it.
STATS = ["num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free"]
VGG_WIDTHS = (16, 32, 64, 128)


class Vgg(nn.Module):
    def __init__(self, image=64, widths=(16, 32, 64, 128), classes=10):
        super().__init__()
        layers, c_in = [], 3
        for w in widths:
            layers += [nn.Conv2d(c_in, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU()]
            layers += [nn.Conv2d(w, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU(), nn.MaxPool2d(2)]
            c_in = w
        side = image // 16
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(c_in * side * side, 256), nn.ReLU(), nn.Dropout(0.5), nn.Linear(256, classes)
        )

    def forward(self, x):
        return self.head(self.features(x))


class Gru(nn.Module):
    def __init__(self, vocab=65, embed=32, hidden=1024):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.gru = nn.GRU(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x):
        out, _ = self.gru(self.embed(x))
        return self.head(out)


def make(model):
    """The model, its optimizer, and one batch's inputs and targets at `batch`."""
    if model == "resnet18":
        net = ResNet18(10).cuda()
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, foreach=False)
        data = lambda b: (torch.rand(b, 3, 64, 64), torch.randint(10, (b,)))
        loss = lambda out, y: F.cross_entropy(out, y)
    elif model == "vgg":
        net = Vgg(widths=VGG_WIDTHS).cuda()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=False)
        data = lambda b: (torch.rand(b, 3, 64, 64), torch.randint(10, (b,)))
        loss = lambda out, y: F.cross_entropy(out, y)
    else:
        net = Gru().cuda()
        opt = torch.optim.Adam(net.parameters(), lr=1e-3, foreach=False)
        data = lambda b: (torch.randint(65, (b, 256)), torch.randint(65, (b, 256)))
        loss = lambda out, y: F.cross_entropy(out.reshape(-1, 65), y.reshape(-1))
    return net, opt, data, loss


def segments_now():
    return [
        [s["address"], s["total_size"], [[b["size"], b["state"] == "active_allocated"] for b in s["blocks"]]]
        for s in torch.cuda.memory._snapshot()["segments"]
        if s["device"] == 0
    ]


def trial(model, batch, steps, amp, accumulate=1):
    torch.manual_seed(0)
    net, opt, data, loss_of = make(model)
    batches = [data(batch) for _ in range(steps)]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    stats_before = {k: torch.cuda.memory_stats().get(k, 0) for k in STATS}
    begin = {
        "allocated": torch.cuda.memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
        "segments": segments_now(),
    }
    torch.cuda.memory._record_memory_history(max_entries=4_000_000, context=None, stacks="python")
    raw_step_begins = 0
    for step, (x, y) in enumerate(batches):
        if step == len(batches) - 1:
            raw_step_begins = len(torch.cuda.memory._snapshot()["device_traces"][0])
        x, y = x.cuda(), y.cuda()
        if accumulate == 1:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                loss = loss_of(net(x), y)
            opt.zero_grad()
            loss.backward()
        else:
            opt.zero_grad()
            for xs, ys in zip(x.chunk(accumulate), y.chunk(accumulate)):
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                    loss = loss_of(net(xs), ys) * (xs.shape[0] / x.shape[0])
                loss.backward()
                del xs, ys
        if model == "gru":
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5, foreach=False)
        opt.step()
        loss.item()
        del x, y, loss
    torch.cuda.synchronize()
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    events = [[ACTIONS[e["action"]], e["addr"], e["size"]] for e in trace if e["action"] in ACTIONS]
    step_begins = sum(1 for e in trace[:raw_step_begins] if e["action"] in ACTIONS)
    parameters = [[list(p.shape), p.element_size()] for p in net.parameters() if p.requires_grad]
    result = {
        "model": model,
        "amp": amp,
        "batch": batch,
        "accumulate": accumulate,
        "parameters": parameters,
        "step_begins": step_begins,
        "steps": steps,
        "begin": begin,
        "events": events,
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "peak_reserved": torch.cuda.max_memory_reserved(),
        "stats": {k: torch.cuda.memory_stats().get(k, 0) - v for k, v in stats_before.items()},
        "ooms": [e["size"] for e in trace if e["action"] == "oom"],
    }
    del net, opt, batches
    torch.cuda.empty_cache()
    return result


BATCHES = {"resnet18": [32, 64, 128, 256, 512], "vgg": [32, 64, 128, 256], "gru": [16, 32, 64, 128, 256]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--models", default="resnet18,vgg,gru")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--amp", action="store_true")
    ap.add_argument("--vgg-widths", default="16,32,64,128", help="64,128,256,512: the corpus's H200 size")
    ap.add_argument("--cudnn-benchmark", action="store_true")
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--batches", help="instead of each model's own list")
    args = ap.parse_args()
    global VGG_WIDTHS
    VGG_WIDTHS = tuple(int(w) for w in args.vgg_widths.split(","))
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    os.makedirs(args.out, exist_ok=True)
    for model in args.models.split(","):
        for p in range(args.passes):
            batches = [int(b) for b in args.batches.split(",")] if args.batches else BATCHES[model]
            for batch in batches:
                r = trial(model, batch, args.steps, args.amp, args.accumulate)
                acc = f"-acc{args.accumulate}" if args.accumulate > 1 else ""
                name = f"{model}{'-bf16' if args.amp else ''}{acc}-{batch}-{p}.json"
                with open(os.path.join(args.out, name), "w") as f:
                    json.dump(r, f, separators=(",", ":"))
                mib = 1 << 20
                print(
                    f"{name}: events {len(r['events'])}, peak allocated {r['peak_allocated'] / mib:.1f} MiB, "
                    f"reserved {r['peak_reserved'] / mib:.1f} MiB, {r['stats']}, ooms {r['ooms'][:4]}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
