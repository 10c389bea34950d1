"""Peak-reserved ranges against their checks, across committed runs: for every `%memestimate
--check` whose peak reserved was told as a range, where the measured peak fell in it (0 the low
end, 1 the high end), and how far three points would have been from it: the one the estimate gave,
the range's middle, and its high end. Split by why the range was given (the estimate's text), and
counted against issue 20's goal (within 10%).

    python3 scripts/gpu/analysis/reserved_points.py results/gpu/2026-12-06-*/
"""
import glob
import json
import sys

ESTIMATE = "application/vnd.tchmem.estimate+json"
# The verdict's reason for the range (src/report/fit.rs, `why_reserved`).
WHY = {
    "where the device puts new segments": "segment order",
    "rules missed the larger calibration trial": "rules missed the trial",
    "calibration trials' caches disagree": "trials disagree",
}

WHY_NAMES = {"segment_order": "segment order", "rules_missed_trial": "rules missed the trial",
             "trials_disagree": "trials disagree"}


def why(text):
    return next((name for key, name in WHY.items() if key in text), "?")


def ranged_checks(notebook):
    """(magic line, why, low, point, high, measured) for each ranged check of `notebook`."""
    for cell in json.load(open(notebook))["cells"]:
        source = "".join(cell["source"])
        if not source.startswith("%memestimate"):
            continue
        text = "".join(
            "".join(o.get("data", {}).get("text/plain", "")) for o in cell.get("outputs", [])
        )
        for output in cell.get("outputs", []):
            e = output.get("data", {}).get(ESTIMATE)
            if not e or "measured_peak_reserved" not in e or e.get("peak_reserved_low") is None:
                continue
            low, high = e["peak_reserved_low"], e["peak_reserved_high"]
            if high <= low:
                continue
            # The JSON names the reason from 2026-12-06 on; the text before.
            reason = WHY_NAMES.get(e.get("peak_reserved_why"), why(text))
            yield (source.splitlines()[0], reason, low, e["peak_reserved"], high,
                   e["measured_peak_reserved"])


def error(predicted, measured):
    return 100.0 * (predicted / measured - 1.0)


def main(folders):
    rows = []
    for folder in folders:
        for notebook in sorted(glob.glob(f"{folder}/**/*.ipynb", recursive=True)):
            for line, reason, low, point, high, measured in ranged_checks(notebook):
                rows.append((notebook, line, reason, low, point, high, measured))
    print(f"{'notebook':58s} {'check':30s} {'why':22s} {'where':>5s} "
          f"{'point':>6s} {'middle':>6s} {'high':>6s} {'width':>5s}")
    within = {"point": 0, "middle": 0, "high": 0}
    exact = dict(within)
    for notebook, line, reason, low, point, high, measured in rows:
        errors = {
            "point": error(point, measured),
            "middle": error((low + high) / 2, measured),
            "high": error(high, measured),
        }
        for name, e in errors.items():
            within[name] += abs(e) <= 10.0
            exact[name] += abs(e) <= 1.0
        where = (measured - low) / (high - low)
        print(f"{notebook[-58:]:58s} {line[12:42]:30s} {reason:22s} {where:5.2f} "
              + " ".join(f"{errors[k]:+6.1f}" for k in ("point", "middle", "high"))
              + f" {error(high, low):5.1f}")
    print(f"{len(rows)} ranged checks; within 10% / within 1% of the measured peak reserved:")
    for name in within:
        print(f"  {name:7s} {within[name]:3d} / {exact[name]:3d}")
    # Which end the measured peak took (within 1%), for the ranges whose point was one end.
    ends = {}
    for _, _, reason, low, point, high, measured in rows:
        if point not in (low, high):
            continue
        other = high if point == low else low
        end = ("the point's end" if abs(error(point, measured)) <= 1.0
               else "the other end" if abs(error(other, measured)) <= 1.0 else "neither")
        ends.setdefault(reason, {}).setdefault(end, 0)
        ends[reason][end] += 1
    print("where the point was an end, the end the measured peak took (within 1%):")
    for reason, counts in sorted(ends.items()):
        print(f"  {reason:22s} " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))


if __name__ == "__main__":
    main(sys.argv[1:] or ["results/gpu"])
