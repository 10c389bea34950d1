"""Ratio table of the GPT benchmark: ours (tch) / PyTorch per technique, peak memory and step
time, plus each run's peak against its own framework's plain run. Peaks are the allocator's
allocated bytes (block sizes); "requested Δ" compares the bytes asked for, which leaves out the
allocator's rounding and the slack of reused blocks.

    python3 gpt_table.py gpt-tch.jsonl gpt-pytorch.jsonl
"""

import json
import sys


def load(path):
    runs = {}
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            run = json.loads(line)
            runs[run["config"]] = run
    return runs


def gib(n):
    return f"{n / 2**30:.2f}" if n is not None else "–"


def main(ours_path, theirs_path):
    ours, theirs = load(ours_path), load(theirs_path)
    any_run = next(iter(ours.values()))
    print(f"GPT, {any_run['parameters'] / 1e6:.1f}M parameters, batch {any_run['batch']}×{any_run['seq']}, "
          f"{any_run['layers']} layers, {any_run['steps']} steps; step time = median after the first step\n")
    print("| technique | peak GiB ours | peak GiB PyTorch | peak ratio | peak Δ MiB | requested Δ MiB | step ms ours | step ms PyTorch | time ratio | plain/peak ours | plain/peak PyTorch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, run in ours.items():
        other = theirs.get(name, {})
        if other.get("skipped"):
            other = {}
        peak_ratio = run["peak_allocated"] / other["peak_allocated"] if other.get("peak_allocated") else None
        time_ratio = (run["median_step_seconds"] / other["median_step_seconds"]
                      if other.get("median_step_seconds") else None)
        ours_gain = ours["plain"]["peak_allocated"] / run["peak_allocated"] if "plain" in ours else None
        theirs_gain = (theirs["plain"]["peak_allocated"] / other["peak_allocated"]
                       if "plain" in theirs and other.get("peak_allocated") else None)
        peak_delta = ((run["peak_allocated"] - other["peak_allocated"]) / 2**20
                      if other.get("peak_allocated") else None)
        requested_delta = ((run["peak_requested"] - other["peak_requested"]) / 2**20
                           if run.get("peak_requested") and other.get("peak_requested") else None)
        fmt = lambda x, spec: format(x, spec) if x is not None else "–"
        print(f"| {name} | {gib(run['peak_allocated'])} | {gib(other.get('peak_allocated'))} | {fmt(peak_ratio, '.4f')} | "
              f"{fmt(peak_delta, '+.1f')} | {fmt(requested_delta, '+.2f')} | "
              f"{fmt(run['median_step_seconds'] and run['median_step_seconds'] * 1000, '.1f')} | "
              f"{fmt(other.get('median_step_seconds') and other['median_step_seconds'] * 1000, '.1f')} | {fmt(time_ratio, '.3f')} | "
              f"{fmt(ours_gain, '.2f')}x | {fmt(theirs_gain, '.2f')}x |")


if __name__ == "__main__":
    main(*sys.argv[1:3])
