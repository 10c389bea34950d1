"""Every `%memestimate --check` of the executed notebooks in the given folders, one line each:
peak allocated and peak reserved errors against the check's own trial (with whether the measured
peak reserved fell in its range, where one was told), and the measured step beside the predicted
point and range.

    python3 scripts/gpu/analysis/estimate_checks.py results/gpu/2026-12-06-reserved-middle/run1 \
      results/gpu/2026-12-06-reserved-middle/run2
"""
import glob
import json
import sys

ESTIMATE = "application/vnd.tchmem.estimate+json"


def checks(notebook):
    """(magic line, estimate JSON, the cell's text output) of each checked estimate in
    `notebook`."""
    for cell in json.load(open(notebook))["cells"]:
        source = "".join(cell["source"]).splitlines()
        if not source or not source[0].startswith("%memestimate"):
            continue
        outputs = cell.get("outputs", [])
        text = "".join("".join(o.get("data", {}).get("text/plain", "")) for o in outputs)
        for output in outputs:
            e = output.get("data", {}).get(ESTIMATE)
            # A check whose trial failed or ran out of memory measured nothing.
            if e and e.get("measured_peak_allocated") is not None:
                yield source[0], e, text


def main(folders):
    notebooks = sorted(sum((glob.glob(f"{d}/**/*.ipynb", recursive=True) for d in folders), []))
    for notebook in notebooks:
        family = notebook.split("/")[-1].split(".")[0]
        for line, e, _ in checks(notebook):
            allocated = 100 * (e["peak_allocated"] / e["measured_peak_allocated"] - 1)
            reserved = 100 * (e["peak_reserved"] / e["measured_peak_reserved"] - 1)
            low, high = e.get("peak_reserved_low"), e.get("peak_reserved_high")
            held = "" if low is None else ("in" if low <= e["measured_peak_reserved"] <= high
                                           else "OUT")
            measured = e["measured_step_seconds"] * 1e3
            point = e["step_seconds"] * 1e3
            # Runs before the step's range was in the JSON show none.
            step_range = (f"[{e['step_seconds_low'] * 1e3:.1f}-{e['step_seconds_high'] * 1e3:.1f}]"
                          if e.get("step_seconds_low") is not None else "")
            print(f"{family:13s} {line[12:40]:28s} alloc {allocated:+5.1f}  res {reserved:+5.1f} "
                  f"{held:3s} step {measured:6.1f} pred {point:6.1f} "
                  f"{step_range} {100 * (point / measured - 1):+5.0f}%")


if __name__ == "__main__":
    main(sys.argv[1:])
