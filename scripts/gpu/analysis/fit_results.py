"""Reads an executed notebooks/04-will-it-fit.ipynb and writes what it measured: each
`%memestimate --check` (predicted and measured peaks, their errors), each `%memfit` search (its
trials, the bracket it ended with) and `%%optimize --fit` (the confirmed candidates).

    python3 scripts/gpu/analysis/fit_results.py EXECUTED.ipynb > results.json   (a table on stderr)
"""
import json
import sys

ESTIMATE = "application/vnd.tchmem.estimate+json"
TRIALS = "application/vnd.tchmem.trials+json"


def datas(cell):
    return [o["data"] for o in cell.get("outputs", []) if "data" in o]


def main(path):
    nb = json.load(open(path))
    estimates, searches, fits = [], [], []
    for cell in nb["cells"]:
        source = "".join(cell["source"])
        for data in datas(cell):
            if ESTIMATE in data and data[ESTIMATE].get("measured_peak_allocated"):
                e = data[ESTIMATE]
                estimates.append({
                    "what": e["what"],
                    "predicted_peak_allocated": e["peak_allocated"],
                    "measured_peak_allocated": e["measured_peak_allocated"],
                    "allocated_error": e["peak_allocated"] / e["measured_peak_allocated"] - 1,
                    "predicted_peak_reserved": e["peak_reserved"],
                    "measured_peak_reserved": e["measured_peak_reserved"],
                    "reserved_error": e["peak_reserved"] / e["measured_peak_reserved"] - 1,
                    "predicted_step_seconds": e["step_seconds"],
                    "measured_step_seconds": e["measured_step_seconds"],
                })
            if TRIALS in data and "confirmed" in data[TRIALS]:
                fits.append(data[TRIALS])
        if source.startswith("%memfit"):
            trials = [d[TRIALS]["trials"] for d in datas(cell) if TRIALS in d][-1]
            search = [t for t in trials if not t["rewrites"]]
            fitting = [t["batch"] for t in search if t["verdict"] == "fits"]
            best = max(fitting) if fitting else None
            too_big = min((t["batch"] for t in search if t["verdict"] != "fits" and best and t["batch"] > best),
                          default=None)
            searches.append({"magic": source.splitlines()[0], "trials": trials, "search_trials": len(search),
                             "largest_that_fits": best, "smallest_that_does_not": too_big})
    print(f"{'estimate':<60} {'alloc err':>9} {'resv err':>9}", file=sys.stderr)
    for e in estimates:
        print(f"{e['what']:<60} {e['allocated_error']:>+9.1%} {e['reserved_error']:>+9.1%}", file=sys.stderr)
    for s in searches:
        print(f"{s['magic']}: {s['largest_that_fits']} fits, {s['smallest_that_does_not']} does not, "
              f"{s['search_trials']} search trials", file=sys.stderr)
    for f in fits:
        for c in f["confirmed"]:
            print(f"--fit: {c['rewrites']:<60} measured {c['measured_peak_reserved'] + c['context']:>12} "
                  f"{c['measured_step_seconds'] * 1e3:7.1f} ms fits {c['fits']}", file=sys.stderr)
    json.dump({"notebook": path, "estimates": estimates, "memfit": searches, "fit": fits}, sys.stdout, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
