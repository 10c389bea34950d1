"""The GPT of runtime/examples/gpt_bench.rs in PyTorch, with each %%optimize technique done the
PyTorch way (torch.utils.checkpoint, torch.autocast + torch.amp.GradScaler, accumulation,
torch.optim.SGD / Adafactor, a Lion written like the paper, Liger-Kernel's fused linear
cross-entropy, the optimizer stepped in backward through post-accumulate-grad hooks,
torch.autograd.graph.save_on_cpu). Prints one JSON line per configuration, in the same format,
for scripts/gpu/compare-gpt.

    python bench_pytorch.py [--steps N] [--batch B] [--seq T] [--layers L] [CONFIG...]

The fused loss is Liger-Kernel's (liger_kernel importable: compare-gpt puts its wheel from
.gpu/wheels on PYTHONPATH); where it does not import or its Triton kernel fails a first check,
a chunked PyTorch version in this file takes its place ("anchor": "chunked-pytorch" and the
error in the JSON line). GPT_BENCH_FUSED_LOSS=chunked takes the chunked one outright.
"""

import argparse
import json
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

VOCAB, WIDTH, HEADS = 50304, 1024, 16
DEVICE = "cuda"


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
    def __init__(self, layers, seq, checkpoint, offload=False, fused_loss=None):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(seq, WIDTH)
        self.h = nn.Sequential(*[Block() for _ in range(layers)])
        self.ln_f = nn.LayerNorm(WIDTH)
        self.checkpoint = checkpoint
        # offload: the tensors the blocks save for backward (with checkpointing: each segment's
        # input) go to pinned host memory and come back for backward.
        self.offload = offload
        # fused_loss(hidden [N, WIDTH], head weight [VOCAB, WIDTH], targets [N]): the mean
        # cross-entropy of the tied head without the [N, VOCAB] logits (None: the plain head).
        self.fused_loss = fused_loss
        # GPT-2's N(0, 0.02) for embeddings, as in gpt_bench.rs.
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)

    def loss(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        if self.offload:
            # Non-reentrant checkpointing saves each segment's input through the saved-tensor
            # hooks in force (these), what the segment saves inside through its own. Only the
            # checkpointed segments run under them, as in gpt_bench.rs: the last block (not
            # recomputed) keeps its activations on the device (checkpoint_sequential inside
            # save_on_cpu would move those to the host too).
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                for block in self.h[:-1]:
                    x = checkpoint(block, x, use_reentrant=False)
            x = self.h[-1](x)
        else:
            x = self.blocks(x)
        x = self.ln_f(x)
        if self.fused_loss is not None:
            return self.fused_loss(x.reshape(-1, WIDTH), self.wte.weight, targets.reshape(-1))
        logits = x @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))

    def blocks(self, x):
        if self.checkpoint:
            # One segment per block; the last one is not recomputed (as in gpt_bench.rs).
            return checkpoint_sequential(self.h, len(self.h), x, use_reentrant=False)
        return self.h(x)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of hidden @ weight.T against targets (ignore_index skipped), chunk by
    chunk of rows: forward computes the loss and both gradients at once (as Liger-Kernel does),
    so no [N, V] logits exist beyond one chunk's and nothing but the two gradients is kept for
    backward. Under autocast the matmuls run in its dtype, the softmax in float32 (at least); the
    weight's gradient accumulates in the weight's dtype."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index=-100):
        device = hidden.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
        else:
            dtype = torch.promote_types(hidden.dtype, weight.dtype)
        n, h = hidden.shape
        v = weight.shape[0]
        # Liger's chunking: a chunk's logits about as large as the hidden states (N x H).
        chunk = min(n, 1 << max(0, math.ceil(math.log2(math.ceil(n / math.ceil(v / h))))))
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # The softmax and the loss: float32 at least.
        wide = torch.promote_types(dtype, torch.float32)
        with torch.autocast(device, enabled=False):
            w = weight.to(dtype)
            valid = targets != ignore_index
            # Per-token weight of the mean, 0 on ignored tokens (a tensor: no synchronization).
            scale = valid.to(wide) / valid.sum()
            loss = torch.zeros((), dtype=wide, device=hidden.device)
            grad_hidden = torch.empty_like(hidden) if want_hidden else None
            grad_weight = torch.zeros_like(weight) if want_weight else None
            for start in range(0, n, chunk):
                end = min(start + chunk, n)
                x = hidden[start:end].to(dtype)
                t = targets[start:end].masked_fill(~valid[start:end], 0)[:, None]
                s = scale[start:end, None]
                logits = (x @ w.t()).to(wide)
                lse = torch.logsumexp(logits, 1, keepdim=True)
                loss += ((lse - logits.gather(1, t)) * s).sum()
                if not (want_hidden or want_weight):
                    continue
                # d loss / d logits = (softmax - onehot) * scale, in place of the logits.
                probs = logits.sub_(lse).exp_()
                probs.scatter_add_(1, t, torch.full_like(s, -1.0))
                g = probs.mul_(s).to(dtype)
                del logits, probs
                if want_hidden:
                    grad_hidden[start:end] = g @ w
                if want_weight:
                    _accumulate(grad_weight, g.t(), x)
        ctx.grads = (grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # Scaled in place and handed over: a second backward through the same graph has
        # nothing left.
        if ctx.grads is None:
            raise RuntimeError("ChunkedLinearCrossEntropy: backward runs once per forward")
        grad_hidden, grad_weight = ctx.grads
        ctx.grads = None
        if grad_hidden is not None:
            grad_hidden.mul_(grad_loss)
        if grad_weight is not None:
            grad_weight.mul_(grad_loss)
        return grad_hidden, grad_weight, None, None


def _accumulate(acc, a, b):
    """acc += a @ b, acc in a wider dtype than a and b without an acc-sized temporary where
    addmm's out_dtype allows (CUDA, torch >= 2.8)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    try:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    except (TypeError, RuntimeError):
        acc += (a @ b).to(acc.dtype)


def chunked_linear_cross_entropy(hidden, weight, targets):
    return ChunkedLinearCrossEntropy.apply(hidden, weight, targets, -100)


# (function, JSON fields naming it) of the fused loss, chosen once per process.
_FUSED_LOSS = None


def fused_loss():
    global _FUSED_LOSS
    if _FUSED_LOSS is not None:
        return _FUSED_LOSS
    error = None
    if os.environ.get("GPT_BENCH_FUSED_LOSS") == "chunked":
        error = "GPT_BENCH_FUSED_LOSS=chunked"
    else:
        try:
            from importlib.metadata import version

            from liger_kernel.ops import LigerFusedLinearCrossEntropyFunction
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

            def liger(hidden, weight, targets):
                # (input [BT, H], weight [V, H], target [BT]); its defaults: bias None,
                # ignore_index -100, reduction "mean".
                return liger_fused_linear_cross_entropy(
                    hidden, weight, targets, ignore_index=-100, reduction="mean")

            fields = {"anchor": f"liger-kernel {version('liger-kernel')}",
                      "anchor_impl": LigerFusedLinearCrossEntropyFunction.__module__}
            fields["anchor_check"] = check_fused_loss(liger)
            _FUSED_LOSS = (liger, fields)
            return _FUSED_LOSS
        except Exception as e:  # import, Triton compile or launch, or a wrong result
            error = f"{type(e).__name__}: {e}"[:2000]
    fields = {"anchor": "chunked-pytorch", "anchor_error": error}
    fields["anchor_check"] = check_fused_loss(chunked_linear_cross_entropy)
    _FUSED_LOSS = (chunked_linear_cross_entropy, fields)
    return _FUSED_LOSS


def check_fused_loss(loss_fn, rows=64, hidden=64):
    """Loss and gradients of loss_fn against F.cross_entropy on the full logits, float32, on a
    small problem with the benchmark's vocabulary (some targets ignored); raises past a
    relative error of 1e-3. Runs before the model is seeded and built (its own generator), and
    gives back what it allocated."""
    g = torch.Generator(device=DEVICE).manual_seed(1234)
    h = torch.randn(rows, hidden, device=DEVICE, generator=g).requires_grad_()
    w = (torch.randn(VOCAB, hidden, device=DEVICE, generator=g) * 0.1).requires_grad_()
    t = torch.randint(VOCAB, (rows,), device=DEVICE, generator=g)
    t[::7] = -100
    loss = loss_fn(h, w, t)
    grad_h, grad_w = torch.autograd.grad(loss, (h, w))
    ref = F.cross_entropy(h @ w.t(), t)
    ref_h, ref_w = torch.autograd.grad(ref, (h, w))
    rel = lambda a, b: ((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
    errors = {"loss": rel(loss.detach(), ref.detach()), "grad_hidden": rel(grad_h, ref_h),
              "grad_weight": rel(grad_w, ref_w)}
    del h, w, t, loss, grad_h, grad_w, ref, ref_h, ref_w
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    if not all(e < 1e-3 for e in errors.values()):
        raise RuntimeError(f"fused loss differs from F.cross_entropy: {errors}")
    return errors


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
    # Liger-Kernel's fused linear cross-entropy: no [B*T, VOCAB] logits.
    "fused-loss": dict(fused_loss=True),
    "fused-loss-bf16": dict(amp=torch.bfloat16, optimizer="adamw-fused", fused_loss=True),
    # PyTorch's optimizer-in-backward recipe: each parameter stepped (and its gradient freed) as
    # soon as its gradient is accumulated.
    "step-in-backward": dict(optimizer="adamw-fused-in-backward",
                             anchor="post-accumulate-grad hooks, AdamW(fused=True) per parameter"),
    # Checkpointing with the segment inputs in pinned host memory.
    "offload": dict(checkpoint=True, offload=True,
                    anchor="checkpoint per block + save_on_cpu(pin_memory=True) around the checkpointed ones"),
    # compress-int8 has no PyTorch counterpart (main prints a "skipped" line).
    # The lowest-memory recipe, PyTorch's way: checkpointing with offload, bf16 autocast, the
    # fused loss and Adafactor stepped in backward, no accumulation.
    "lowest": dict(checkpoint=True, offload=True, amp=torch.bfloat16, fused_loss=True,
                   optimizer="adafactor-in-backward"),
    # Ours with the fused loss in chunks of 128 tokens; Liger sizes its own chunks.
    "lowest-128": dict(checkpoint=True, offload=True, amp=torch.bfloat16, fused_loss=True,
                       optimizer="adafactor-in-backward"),
}


# --adamw: which of PyTorch's AdamW implementations: "default" (multi-tensor, foreach),
# "single-tensor" (per parameter, the way libtorch's C++ AdamW, tch's nn::AdamW, works) or
# "fused" (one kernel, as tchmem::optim::AdamW).
ADAMW = "default"
# --no-early-stop: checkpointing reruns each segment to its end (PyTorch stops a rerun once it
# has the last tensor backward needs; so does tchmem's checkpoint).
EARLY_STOP = True


class InBackward:
    """PyTorch's optimizer-in-backward recipe: one optimizer per parameter, stepped by the
    parameter's post-accumulate-grad hook (after its gradient of the whole backward, tied uses
    summed, is in .grad), which then frees the gradient. step and zero_grad do nothing."""

    def __init__(self, make, params):
        self.optimizers = {p: make([p]) for p in params}
        self.handles = [p.register_post_accumulate_grad_hook(self.hook) for p in self.optimizers]

    def hook(self, p):
        opt = self.optimizers[p]
        opt.step()
        opt.zero_grad(set_to_none=True)

    def zero_grad(self, set_to_none=True):
        pass

    def step(self):
        pass


def optimizer(name, params, lr=3e-4):
    if name.endswith("-in-backward"):
        base = name[: -len("-in-backward")]
        return InBackward(lambda ps: optimizer(base, ps, lr), params)
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
    cfg = dict(checkpoint=False, amp=None, micro_batches=1, optimizer="adamw", offload=False,
               fused_loss=False, anchor=None)
    cfg.update(CONFIGS[name])
    in_backward = cfg["optimizer"].endswith("-in-backward")
    # A step per backward: accumulation would step on each micro-batch's gradient.
    assert not in_backward or (cfg["micro_batches"] == 1 and cfg["amp"] != torch.float16)
    extra = {"anchor": cfg["anchor"]} if cfg["anchor"] else {}
    loss_fn = None
    if cfg["fused_loss"]:
        # Before the seed: its check draws from its own generator, and frees what it took.
        loss_fn, fields = fused_loss()
        extra.update(fields)
    # GPT_BENCH_PHASES=1: (point, allocated, peak) at the points gpt_bench.rs marks too.
    phases = [] if os.environ.get("GPT_BENCH_PHASES") == "1" else None

    def mark(point):
        if phases is not None:
            torch.cuda.synchronize()
            phases.append([point, torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()])

    torch.manual_seed(0)
    model = Gpt(layers, seq, cfg["checkpoint"], cfg["offload"], loss_fn).to(DEVICE)
    mark("model")
    opt = optimizer(cfg["optimizer"], model.parameters())
    scaler = torch.amp.GradScaler(DEVICE) if cfg["amp"] == torch.float16 else None
    idx = torch.randint(VOCAB, (batch, seq), device=DEVICE)
    targets = torch.randint(VOCAB, (batch, seq), device=DEVICE)
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
            with torch.autocast(DEVICE, dtype=cfg["amp"] or torch.float32, enabled=cfg["amp"] is not None):
                loss = model.loss(x, y)
            loss = loss * weight
            mark("forward")
            # With an optimizer in backward, the parameters are stepped in here.
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
        **extra,
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
