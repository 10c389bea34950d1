"""The GPT of runtime/examples/gpt_bench.rs in PyTorch, with each %%optimize technique done the
PyTorch way (torch.utils.checkpoint, torch.autocast + torch.amp.GradScaler, accumulation,
torch.optim.SGD / Adafactor, a Lion written like the paper). Prints one JSON line per
configuration, in the same format, for scripts/gpu/compare-gpt.

    python bench_pytorch.py [--steps N] [--batch B] [--seq T] [--layers L] [CONFIG...]
"""

import argparse
import json
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint_sequential

VOCAB, WIDTH, HEADS = 50304, 1024, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.attn = nn.Linear(WIDTH, 3 * WIDTH)
        self.attn_proj = nn.Linear(WIDTH, WIDTH)
        self.ln2 = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.fc_proj = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.attn(self.ln1(x)).split(c, 2)
        heads = lambda p: p.view(b, t, HEADS, c // HEADS).transpose(1, 2)
        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self, layers, seq, checkpoint):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(seq, WIDTH)
        self.h = nn.Sequential(*[Block() for _ in range(layers)])
        self.ln_f = nn.LayerNorm(WIDTH)
        self.checkpoint = checkpoint
        # GPT-2's N(0, 0.02) for embeddings, as in gpt_bench.rs.
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)

    def loss(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        if self.checkpoint:
            # One segment per block; the last one is not recomputed (as in gpt_bench.rs).
            x = checkpoint_sequential(self.h, len(self.h), x, use_reentrant=False)
        else:
            x = self.h(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023), one momentum buffer per parameter."""

    def __init__(self, params, lr, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = (m * beta1 + p.grad * (1 - beta1)).sign_()
                p.add_(update, alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)


CONFIGS = {
    "plain": dict(),
    "checkpoint": dict(checkpoint=True),
    # %%optimize --amp swaps tch's AdamW for tchmem's fused one; PyTorch's fused AdamW is the
    # like-for-like (and the faster) counterpart.
    "bf16": dict(amp=torch.bfloat16, optimizer="adamw-fused"),
    "f16": dict(amp=torch.float16, optimizer="adamw-fused"),
    # Mixed precision with the default AdamW (gpt_bench.rs: with tch's own AdamW).
    "bf16-tch-adamw": dict(amp=torch.bfloat16),
    "f16-tch-adamw": dict(amp=torch.float16),
    "accumulate4": dict(micro_batches=4),
    "sgd": dict(optimizer="sgd"),
    "lion": dict(optimizer="lion"),
    "adafactor": dict(optimizer="adafactor"),
    "combined": dict(checkpoint=True, amp=torch.bfloat16, micro_batches=4, optimizer="adafactor"),
}


# --adamw: which of PyTorch's AdamW implementations: "default" (multi-tensor, foreach),
# "single-tensor" (per parameter, the way libtorch's C++ AdamW, tch's nn::AdamW, works) or
# "fused" (one kernel, as tchmem::optim::AdamW).
ADAMW = "default"
# --no-early-stop: checkpointing reruns each segment to its end (PyTorch stops a rerun once it
# has the last tensor backward needs; so does tchmem's checkpoint).
EARLY_STOP = True


def optimizer(name, params, lr=3e-4):
    if name == "adamw-fused":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, fused=True)
    if name == "adamw":
        implementation = {"default": {}, "single-tensor": dict(foreach=False),
                          "fused": dict(fused=True)}[ADAMW]
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, **implementation)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "lion":
        return Lion(params, lr=lr / 3)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=lr)
    raise ValueError(name)


def run(name, steps, batch, seq, layers):
    cfg = dict(checkpoint=False, amp=None, micro_batches=1, optimizer="adamw")
    cfg.update(CONFIGS[name])
    # GPT_BENCH_PHASES=1: (point, allocated, peak) at the points gpt_bench.rs marks too.
    phases = [] if os.environ.get("GPT_BENCH_PHASES") == "1" else None

    def mark(point):
        if phases is not None:
            torch.cuda.synchronize()
            phases.append([point, torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()])

    torch.manual_seed(0)
    model = Gpt(layers, seq, cfg["checkpoint"]).cuda()
    mark("model")
    opt = optimizer(cfg["optimizer"], model.parameters())
    scaler = torch.amp.GradScaler("cuda") if cfg["amp"] == torch.float16 else None
    idx = torch.randint(VOCAB, (batch, seq), device="cuda")
    targets = torch.randint(VOCAB, (batch, seq), device="cuda")
    torch.cuda.synchronize()
    mark("data")
    torch.cuda.reset_peak_memory_stats()
    mark("reset")
    times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in zip(idx.chunk(cfg["micro_batches"]), targets.chunk(cfg["micro_batches"])):
            weight = x.shape[0] / batch
            with torch.autocast("cuda", dtype=cfg["amp"] or torch.float32, enabled=cfg["amp"] is not None):
                loss = model.loss(x, y)
            loss = loss * weight
            mark("forward")
            (scaler.scale(loss) if scaler else loss).backward()
            mark("backward")
            total += loss.item()
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        torch.cuda.synchronize()
        mark("step")
        times.append(time.perf_counter() - start)
        losses.append(total)
    later = sorted(times[1:])
    return {
        "framework": "pytorch",
        "config": name,
        "optimizer": cfg["optimizer"],
        "adamw": ADAMW,
        "checkpoint_early_stop": EARLY_STOP,
        "parameters": sum(p.numel() for p in model.parameters()),
        "batch": batch, "seq": seq, "layers": layers, "steps": steps,
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "peak_reserved": torch.cuda.max_memory_reserved(),
        "peak_requested": torch.cuda.memory_stats()["requested_bytes.all.peak"],
        "step_seconds": times,
        "median_step_seconds": later[len(later) // 2] if later else None,
        "losses": losses,
        "phases": phases,
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=13)
    parser.add_argument("--adamw", choices=["default", "single-tensor", "fused"], default="default")
    parser.add_argument("--no-early-stop", action="store_true")
    parser.add_argument("configs", nargs="*", default=list(CONFIGS))
    args = parser.parse_args()
    global ADAMW, EARLY_STOP
    ADAMW = args.adamw
    EARLY_STOP = not args.no_early_stop
    for name in args.configs:
        if name not in CONFIGS:
            print(json.dumps({"framework": "pytorch", "config": name, "skipped": "no PyTorch counterpart"}))
            continue
        with torch.utils.checkpoint.set_checkpoint_early_stop(EARLY_STOP):
            result = run(name, args.steps, args.batch, args.seq, args.layers)
        print(json.dumps(result), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
