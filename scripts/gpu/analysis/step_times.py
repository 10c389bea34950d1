"""Step-time predictions against their checks, across every committed run of the corpus: for each
model x configuration checked more than once, the measured step (stable or not from run to run)
beside the predicted point and range, and how many points are within 20% where the step is at
least 20 ms (issue 20's goal); and of the estimates whose trials profiled the GPU's work
(`predicted_gpu_busy_seconds`, from 2026-12-05), the same count apart, and split by whether
their trials were bound by the host (every trial's step in the table over 1.5x its GPU's work);
and of the `--accumulate` checks, how often the stated range held the step with no slack, by
the kernel's own host-bound flag (`host_bound` in the estimate's JSON; older runs lack it).

    python3 scripts/gpu/analysis/step_times.py results/gpu/2026-12-0[345]-*/
"""
import collections
import glob
import json
import re
import statistics
import sys

ESTIMATE = "application/vnd.tchmem.estimate+json"
# A calibration trial's row in the estimate's text: "1  8  as written  calibration ... 18.4 ms
# (GPU 13.2) ...".
TRIAL_STEP = re.compile(r"^\d+\s+(\d+)\s.*?calibration\s.*?([\d.]+) ms \(GPU ([\d.]+)\)", re.M)
HOST_BOUND_RATIO = 1.5
# A calibration trial of the loop as written: with `--optimizer`, trials that ran the cell's
# optimizer (as they all did until the last change of 2026-12-05), whose steps are not the swap's.
AS_WRITTEN_TRIAL = re.compile(r"^\d+\s+\d+\s+as written\s+calibration\s", re.M)


def trial_steps(text):
    """(batch, step, GPU work) in ms of each calibration trial in the estimate's text."""
    return [(int(b), float(wall), float(work)) for b, wall, work in TRIAL_STEP.findall(text)]


def host_bound(trials):
    """Whether every trial took over 1.5x its GPU's work (None where none profiled it)."""
    return all(wall > HOST_BOUND_RATIO * work for _, wall, work in trials) if trials else None


def host_bound_points(trials, micro, accumulate):
    """Two points for host-bound trials, from the table's steps, per micro-batch (the optimizer
    step each repeats included): the kernel's (src/fit/estimate.rs, host_bound_step) since the
    last change of 2026-12-05, the longer of the trials' mean step (the host's time) and the
    work's line at the batch; and the rule before it, the work plus the least idle time."""
    (b1, _, g1), (b2, _, g2) = trials[0], trials[-1]
    work = g1 + (g2 - g1) / (b2 - b1) * (micro - b1) if b2 != b1 else g2 * micro / b2
    host = statistics.mean(wall for _, wall, _ in trials)
    return {"longer": max(host, work) * accumulate,
            "sum": (work + min(wall - busy for _, wall, busy in trials)) * accumulate}


def checks(notebook):
    """(configuration, predicted point, low, high, measured, GPU work or None, host-bound or
    None, the host-bound points from the trials' table or None, whether an optimizer swap was
    calibrated on the cell's optimizer, the kernel's own host-bound flag or None), in ms, of
    each checked estimate."""
    for cell in json.load(open(notebook))["cells"]:
        for output in cell.get("outputs", []):
            e = output.get("data", {}).get(ESTIMATE)
            if e and e.get("measured_step_seconds"):
                text = "".join(output["data"].get("text/plain", ""))
                trials = trial_steps(text)
                bound = host_bound(trials)
                accumulate = re.search(r"--accumulate (\d+)", e["what"])
                yield (e["what"], e["step_seconds"] * 1e3,
                       e.get("step_seconds_low", e["step_seconds"]) * 1e3,
                       e.get("step_seconds_high", e["step_seconds"]) * 1e3,
                       e["measured_step_seconds"] * 1e3,
                       e["predicted_gpu_busy_seconds"] * 1e3
                       if e.get("predicted_gpu_busy_seconds") else None,
                       bound,
                       host_bound_points(trials, e["micro_batch"], int(accumulate[1]) if accumulate else 1)
                       if bound else None,
                       "--optimizer" in e["what"] and bool(AS_WRITTEN_TRIAL.search(text)),
                       e.get("host_bound"))


def within(checks):
    """How many of `checks` have their predicted point within 20% of the measured step."""
    return sum(abs(c[0] / c[3] - 1) <= 0.2 for c in checks)


def held(checks):
    """How many of `checks` have the measured step within the stated range (a tenth of slack)."""
    return sum(c[1] * 0.9 <= c[3] <= c[2] * 1.1 for c in checks)


def main(folders):
    by = collections.defaultdict(list)
    for folder in folders:
        for notebook in sorted(glob.glob(f"{folder.rstrip('/')}/**/*.ipynb", recursive=True)):
            model = notebook.rsplit("/", 1)[-1].split(".")[0]
            for what, *check in checks(notebook):
                by[(model, what)].append(tuple(check))
    long = [c for runs in by.values() for c in runs if c[3] >= 20]
    print(f"{sum(map(len, by.values()))} checks; {len(long)} with a measured step >= 20 ms: "
          f"point within 20% in {within(long)}, measured within the stated range (a tenth of slack) "
          f"in {held(long)}")
    profiled = [c for c in long if c[4] is not None]
    if profiled:
        set_by_work = [c for c in profiled if c[4] >= c[0] * 0.999]
        print(f"  of them with the GPU's work profiled: {len(profiled)}, point within 20% in "
              f"{within(profiled)}; the work set the point in {len(set_by_work)}, within 20% in "
              f"{within(set_by_work)}")
        for bound, name in ((True, "bound by the host"), (False, "bound by the GPU's work")):
            part = [c for c in profiled if c[5] is bound]
            print(f"  trials {name}: {len(part)}, point within 20% in {within(part)}, measured "
                  f"within the stated range in {held(part)}")
    # Optimizer swaps calibrated on the cell's optimizer apart: their steps were not the swap's.
    hosted = [c for runs in by.values() for c in runs if c[6] is not None and not c[7]]
    if hosted:
        error = lambda point, c: abs(point / c[3] - 1)
        long = [c for c in hosted if c[3] >= 20]
        print(f"  {len(hosted)} host-bound checks (any step, swaps timed on the cell's optimizer "
              f"apart; of 20 ms or more: {len(long)}, the stated range held {held(long)}): median error "
              f"of the kernel's point {statistics.median(error(c[0], c) for c in hosted):.0%}; from "
              f"their table, of the longer of host and work "
              f"{statistics.median(error(c[6]['longer'], c) for c in hosted):.0%} (within 20% in "
              f"{sum(error(c[6]['longer'], c) <= 0.2 for c in long)} of {len(long)} of 20 ms or "
              f"more), of the work plus the least idle time "
              f"{statistics.median(error(c[6]['sum'], c) for c in hosted):.0%} (within 20% in "
              f"{sum(error(c[6]['sum'], c) <= 0.2 for c in long)})")
    # Micro-batches run back to back: how often the stated range (no slack) held the step, by
    # whether the kernel found the trials bound by the host.
    accumulated = [c for (_, what), runs in by.items() if "--accumulate" in what for c in runs]
    if accumulated:
        exact = lambda checks: sum(c[1] <= c[3] <= c[2] for c in checks)
        hosted = [c for c in accumulated if c[8] is True]
        others = [c for c in accumulated if c[8] is False]
        print(f"  {len(accumulated)} --accumulate checks: the stated range (no slack) held the "
              f"step in {exact(others)} of {len(others)} whose trials the host did not bound, "
              f"{exact(hosted)} of {len(hosted)} bound by it")
    print(f"{'model':<12} {'configuration':<44} {'n':>2} {'measured ms':>15} {'spread':>7} "
          f"{'predicted points':>17} {'spread':>7}")
    for (model, what), runs in sorted(by.items()):
        if len(runs) < 2 or max(r[3] for r in runs) < 20:
            continue
        measured = [r[3] for r in runs]
        points = [r[0] for r in runs]
        spread = lambda xs: max(xs) / min(xs) - 1
        print(f"{model:<12} {what[:44]:<44} {len(runs):>2} "
              f"{min(measured):6.1f}-{max(measured):6.1f}  {spread(measured):+6.0%} "
              f"{min(points):7.1f}-{max(points):7.1f}  {spread(points):+6.0%}")


if __name__ == "__main__":
    main(sys.argv[1:])
