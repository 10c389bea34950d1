"""Peak-reserved ranges against their checks, across committed runs: for every `%memestimate
--check` whose peak reserved was told as a range, where the measured peak fell in it (0 the low
end, 1 the high end), and how far four points would have been from it: the one the estimate gave,
the range's arithmetic middle, its balanced middle (2·low·high/(low+high), the same fraction from
either end, what the kernel gives since 2026-12-06) and its high end. Split by why the range was
given, and counted against issue 20's goal (within 10%), over every range and over the
segment-order ranges alone.

    python3 scripts/gpu/analysis/reserved_points.py results/gpu/2026-12-06-begin-state \
      results/gpu/2026-12-06-checkpoint-library results/gpu/2026-12-06-corpus

Which rule gave a segment-order row's `point` depends on the kernel that ran it: the order the
larger trial took until 2b04fe3, the arithmetic middle at 2b04fe3 (`2026-12-06-reserved-middle`'s
run1 and run2), the balanced middle from 385e8d4 (its run3 and run4). The column `rule` says
only whether the point was an end or inside the range.
"""
import glob
import sys

from estimate_checks import checks  # this folder's: the checks of a notebook

# The verdict's reason for the range (src/report/fit.rs, `why_reserved`), for runs whose JSON
# did not name it yet.
WHY = {
    "placed between them another peak": "segment placement",
    "where the device puts new segments": "segment order",
    "rules missed the larger calibration trial": "rules missed the trial",
    "calibration trials' caches disagree": "trials disagree",
}
WHY_NAMES = {"segment_order": "segment order", "segment_placement": "segment placement",
             "rules_missed_trial": "rules missed the trial",
             "trials_disagree": "trials disagree"}
POINTS = ("point", "middle", "balanced", "high")


def why(text):
    return next((name for key, name in WHY.items() if key in text), "?")


def ranged_checks(notebook):
    """(magic line, why, low, point, high, measured) for each ranged check of `notebook` whose
    check trial ran (a check that failed or ran out of memory measured nothing)."""
    for line, e, text in checks(notebook):
        low, high = e.get("peak_reserved_low"), e.get("peak_reserved_high")
        if e.get("measured_peak_reserved") is None or low is None or high is None or high <= low:
            continue
        reason = WHY_NAMES.get(e.get("peak_reserved_why"), why(text))
        yield line, reason, low, e["peak_reserved"], high, e["measured_peak_reserved"]


def error(predicted, measured):
    return 100.0 * (predicted / measured - 1.0)


def points(low, point, high):
    return {"point": point, "middle": (low + high) / 2, "balanced": 2 * low * high / (low + high),
            "high": high}


def count(rows, name):
    """How many of `rows` each point had within 10% and within 1% of the measured peak."""
    print(f"{len(rows)} {name}; within 10% / within 1% of the measured peak reserved:")
    for key in POINTS:
        errors = [error(points(low, point, high)[key], measured)
                  for _, _, _, low, point, high, measured in rows]
        print(f"  {key:9s} {sum(abs(e) <= 10 for e in errors):3d} / "
              f"{sum(abs(e) <= 1 for e in errors):3d}")


def main(folders):
    rows = []
    for folder in folders:
        for notebook in sorted(glob.glob(f"{folder}/**/*.ipynb", recursive=True)):
            for line, reason, low, point, high, measured in ranged_checks(notebook):
                rows.append((notebook, line, reason, low, point, high, measured))
    print(f"{'notebook':58s} {'check':30s} {'why':22s} {'rule':6s} {'where':>5s} "
          + " ".join(f"{k:>8s}" for k in POINTS) + f" {'width':>5s}")
    for notebook, line, reason, low, point, high, measured in rows:
        rule = "an end" if point in (low, high) else "inside"
        where = (measured - low) / (high - low)
        errors = " ".join(f"{error(p, measured):+8.1f}" for p in points(low, point, high).values())
        print(f"{notebook[-58:]:58s} {line[12:42]:30s} {reason:22s} {rule:6s} {where:5.2f} "
              f"{errors} {error(high, low):5.1f}")
    count(rows, "ranged checks")
    count([r for r in rows if r[2] == "segment order"], "segment-order ranges")
    # Which end the measured peak took (within 1%), where the point was an end.
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
