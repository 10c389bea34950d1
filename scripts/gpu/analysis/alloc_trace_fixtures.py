"""Turns `alloc_traces.py`'s traces into the kernel's format (the wire's AllocTrace), for the
estimate's tests: each file {"model", "amp", "batch", "begin_allocated", "peak_allocated",
"peak_reserved",
"accumulate", "parameters": [{"dims", "element_size"}, ...],
"trace": {"segments": [{"large", "blocks": [[bytes, in_use], ...]}], "events": [n | -(k+1)],
"marks": [[0, the last step's first event]] where the trace says where it begins, else []}}. Allocations are numbered as the runtime numbers them: the blocks in use when the
trial began first, then each allocation in order.

Usage: python3 alloc_trace_fixtures.py IN_DIR OUT_DIR
"""

import json
import os
import sys


def convert(raw):
    live, segments, numbered = {}, [], 0
    for address, total, blocks in raw["begin"]["segments"]:
        at = address
        for size, in_use in blocks:
            if in_use:
                live[at] = numbered
                numbered += 1
            at += size
        # Small-pool segments are 2 MiB (kSmallBuffer), large-pool ones 10 MiB or more.
        segments.append({"large": total > 2 << 20,
                         "blocks": [[s, u] for s, u in blocks]})
    events, marks = [], []
    for at, (action, address, size) in enumerate(raw["events"]):
        if at == raw.get("step_begins", -1):
            marks = [[0, len(events)]]
        if action == "a":
            live[address] = numbered
            numbered += 1
            events.append(size)
        elif action == "f" and address in live:
            events.append(-live.pop(address) - 1)
    return {"segments": segments, "events": events, "marks": marks}


def main():
    src, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    for name in sorted(os.listdir(src)):
        if not name.endswith("-0.json"):
            continue
        raw = json.load(open(os.path.join(src, name)))
        fixture = {k: raw[k] for k in ("model", "amp", "batch", "peak_allocated", "peak_reserved")}
        fixture["begin_allocated"] = raw["begin"]["allocated"]
        if "parameters" in raw:
            fixture["accumulate"] = raw["accumulate"]
            fixture["parameters"] = [{"dims": d, "element_size": e} for d, e in raw["parameters"]]
        fixture["trace"] = convert(raw)
        with open(os.path.join(out, name.replace("-0.json", ".json")), "w") as f:
            json.dump(fixture, f, separators=(",", ":"))


if __name__ == "__main__":
    main()
