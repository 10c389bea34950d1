"""Does a GPU left idle for the seconds a cell compiles run the next short trial slower?

Trains a small transformer (tied_gpt's shape at batch 8-32, launch-bound steps of 10-40 ms as
in the kernel's calibration trials) in rounds: sleep IDLE seconds, then time STEPS steps one by
one, reading the SM clock (NVML through nvidia-smi) before and after. Then the same steps with
no sleep between rounds. Prints one line per round.

    python3 idle_clocks.py [--idle 2.5] [--steps 4] [--rounds 4]
"""
import argparse
import subprocess
import time

import torch
from torch import nn


def sm_clock():
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,power.draw,pstate", "--format=csv,noheader"],
        capture_output=True, text=True).stdout.strip()
    return out


def model():
    layer = nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.1, batch_first=True)
    return nn.Sequential(nn.Embedding(8192, 512), nn.TransformerEncoder(layer, 8), nn.Linear(512, 8192)).cuda()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--idle", type=float, default=2.5)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    a = p.parse_args()
    net = model()
    opt = torch.optim.AdamW(net.parameters(), 3e-4, foreach=False)

    def step(batch):
        x = torch.randint(0, 8192, (batch, 256), device="cuda")
        loss = nn.functional.cross_entropy(net(x).flatten(0, 1), x.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()

    for b in (8, 16, 32):
        step(b)
    torch.cuda.synchronize()
    for idle in (a.idle, 0.0):
        for r in range(a.rounds):
            for batch in (8, 16, 32):
                if idle:
                    time.sleep(idle)
                before = sm_clock()
                times = []
                for _ in range(a.steps):
                    t = time.perf_counter()
                    step(batch)
                    times.append((time.perf_counter() - t) * 1e3)
                after = sm_clock()
                print(f"idle {idle:.1f} s round {r} batch {batch:2d}: steps "
                      + " ".join(f"{t:5.1f}" for t in times)
                      + f" ms | clock before: {before} | after: {after}", flush=True)


if __name__ == "__main__":
    main()
