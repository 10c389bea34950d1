"""Ratio table of the GPT benchmark: ours (tch) / PyTorch per technique, peak memory and step
time, plus each run's peak against its own framework's plain run. Peaks are the allocator's
allocated bytes (block sizes); "requested Δ" compares the bytes asked for, which leaves out the
allocator's rounding and the slack of reused blocks. A technique without a PyTorch run (none
exists, as for compress-int8, or its line is missing) shows "—" there and no ratio. Below the
table: what each PyTorch anchor was (Liger-Kernel or the chunked fallback), and the goals of
the `lowest` recipe (peak at least 12x below plain fp32, step time at most 1.3x PyTorch's
`combined`).

    python3 gpt_table.py gpt-tch.jsonl gpt-pytorch.jsonl
"""

import json
import sys

MISSING = "—"
# The lowest-memory recipe's goals: plain fp32 peak / its peak, its step / PyTorch's combined.
LOWEST_PEAK_GAIN = 12.0
LOWEST_TIME_RATIO = 1.3


def load(path):
    runs = {}
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            run = json.loads(line)
            runs[run["config"]] = run
    return runs


def gib(n):
    return f"{n / 2**30:.2f}" if n is not None else MISSING


def fmt(x, spec, suffix=""):
    return format(x, spec) + suffix if x is not None else MISSING


def ratio(a, b):
    return a / b if a is not None and b else None


def ms(run):
    s = run.get("median_step_seconds")
    return s * 1000 if s is not None else None


def main(ours_path, theirs_path):
    ours, theirs = load(ours_path), load(theirs_path)
    # A "skipped" line (no PyTorch counterpart) counts as no line.
    theirs = {name: run for name, run in theirs.items() if not run.get("skipped")}
    names = list(ours) + [name for name in theirs if name not in ours]
    if not names:
        print("no runs")
        return
    any_run = ours[names[0]] if names[0] in ours else theirs[names[0]]
    print(f"GPT, {any_run['parameters'] / 1e6:.1f}M parameters, batch {any_run['batch']}×{any_run['seq']}, "
          f"{any_run['layers']} layers, {any_run['steps']} steps; step time = median after the first step\n")
    print("| technique | peak GiB ours | peak GiB PyTorch | peak ratio | peak Δ MiB | requested Δ MiB | step ms ours | step ms PyTorch | time ratio | plain/peak ours | plain/peak PyTorch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    plain_ours = ours.get("plain", {}).get("peak_allocated")
    plain_theirs = theirs.get("plain", {}).get("peak_allocated")
    for name in names:
        run, other = ours.get(name, {}), theirs.get(name, {})
        peak, other_peak = run.get("peak_allocated"), other.get("peak_allocated")
        requested, other_requested = run.get("peak_requested"), other.get("peak_requested")
        peak_delta = (peak - other_peak) / 2**20 if peak is not None and other_peak is not None else None
        requested_delta = ((requested - other_requested) / 2**20
                           if requested and other_requested else None)
        print(f"| {name} | {gib(peak)} | {gib(other_peak)} | {fmt(ratio(peak, other_peak), '.4f')} | "
              f"{fmt(peak_delta, '+.1f')} | {fmt(requested_delta, '+.2f')} | "
              f"{fmt(ms(run), '.1f')} | {fmt(ms(other), '.1f')} | {fmt(ratio(ms(run), ms(other)), '.3f')} | "
              f"{fmt(ratio(plain_ours, peak), '.2f', 'x')} | {fmt(ratio(plain_theirs, other_peak), '.2f', 'x')} |")

    anchors = [(name, theirs[name]) for name in names if theirs.get(name, {}).get("anchor")]
    if anchors:
        print("\nPyTorch anchors:\n")
        for name, run in anchors:
            note = f"- {name}: {run['anchor']}"
            if run.get("anchor_error"):
                note += f" (Liger-Kernel not used: {run['anchor_error']})"
            print(note)

    # `lowest` and its variants (`lowest-128`: the fused loss in smaller chunks).
    for name in (n for n in names if n.startswith("lowest") and n in ours):
        lowest = ours[name]
        combined = theirs.get("combined", {})
        gain = ratio(plain_ours, lowest.get("peak_allocated"))
        time_ratio = ratio(ms(lowest), ms(combined))
        met = lambda value, ok: MISSING if value is None else ("yes" if ok(value) else "no")
        print(f"\nGoals of `{name}` (ours):\n")
        print("| goal | value | target | met |")
        print("|---|---|---|---|")
        print(f"| plain fp32 peak (ours) / {name} peak (ours) | "
              f"{gib(plain_ours)} / {gib(lowest.get('peak_allocated'))} GiB = {fmt(gain, '.2f', 'x')} | "
              f"≥ {LOWEST_PEAK_GAIN:g}x | {met(gain, lambda g: g >= LOWEST_PEAK_GAIN)} |")
        print(f"| {name} step (ours) / combined step (PyTorch) | "
              f"{fmt(ms(lowest), '.1f')} / {fmt(ms(combined), '.1f')} ms = {fmt(time_ratio, '.3f', 'x')} | "
              f"≤ {LOWEST_TIME_RATIO:g}x | {met(time_ratio, lambda r: r <= LOWEST_TIME_RATIO)} |")

if __name__ == "__main__":
    main(*sys.argv[1:3])
