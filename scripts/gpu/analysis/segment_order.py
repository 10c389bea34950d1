"""Does the order of the device's segment addresses explain where the allocator model misses?

Replays `alloc_traces.py`'s raw traces (which keep every segment's device address) through the
caching allocator's rules, as src/fit/allocator.rs models them, three ways: with the device's own
segment addresses, with every new segment above the ones before (the model's old order), and
below them. Prints each trial's measured peak reserved and each replay's error. Of free blocks
of one size the allocator takes the lowest address, so the order decides which is reused.

Usage: python3 segment_order.py RAW_TRACE.json...
"""

import json
import sys

MIB = 1 << 20


def rounded(size):
    return (max(size, 1) + 511) // 512 * 512


def segment_size(size):
    if size <= MIB:
        return 2 * MIB
    if size < 10 * MIB:
        return 20 * MIB
    return (size + 2 * MIB - 1) // (2 * MIB) * 2 * MIB


def peak_reserved(raw, order):
    """The peak reserved replaying `raw`; new segments at the device's addresses ("device"), or
    above ("above") or below ("below") every segment before."""
    blocks = {}  # address -> [size, in_use, large, segment]
    reserved = 0
    begin = raw["begin"]["segments"]
    new_addresses = iter(address for action, address, _ in raw["events"] if action == "s")
    top = max([a + total for a, total, _ in begin] + [0])
    bottom = min([a for a, _, _ in begin] + [1 << 50])
    for address, total, sizes in begin:
        reserved += total
        at = address
        for size, in_use in sizes:
            blocks[at] = [size, in_use, total > 2 * MIB, address]
            at += size
    peak = reserved
    served = {}  # the device's address of a request -> the replay's
    for action, address, size in raw["events"]:
        if action == "a":
            size = rounded(size)
            large = size > MIB
            fits = sorted((b[0], a) for a, b in blocks.items() if not b[1] and b[2] == large and b[0] >= size)
            if fits:
                free, at = fits[0]
            else:
                free = segment_size(size)
                if order == "device":
                    at = next(new_addresses)
                elif order == "above":
                    at, top = top + 4 * MIB, top + 4 * MIB + free
                else:
                    bottom -= free + 4 * MIB
                    at = bottom
                blocks[at] = [free, False, large, at]
                reserved += free
                peak = max(peak, reserved)
            rest, segment = free - size, blocks[at][3]
            if rest > MIB if large else rest >= 512:
                blocks[at] = [size, True, large, segment]
                blocks[at + size] = [rest, False, large, segment]
            else:
                blocks[at][1] = True
            served[address] = at
        elif action == "f" and address in served:
            at = served.pop(address)
            blocks[at][1] = False
            segment = blocks[at][3]
            after = at + blocks[at][0]
            if after in blocks and not blocks[after][1] and blocks[after][3] == segment:
                blocks[at][0] += blocks.pop(after)[0]
            before = [p for p, b in blocks.items() if p + b[0] == at and b[3] == segment and not b[1]]
            if before:
                blocks[before[0]][0] += blocks.pop(at)[0]
    return peak


def main():
    print(f"{'trial':<22} {'measured':>12}  device   above    below")
    for path in sys.argv[1:]:
        raw = json.load(open(path))
        measured = raw["peak_reserved"]
        errors = [peak_reserved(raw, order) / measured - 1 for order in ("device", "above", "below")]
        name = path.rsplit("/", 1)[-1].replace(".json", "")
        print(f"{name:<22} {measured / MIB:>8.0f} MiB  " + "  ".join(f"{100 * e:+6.1f}%" for e in errors))


if __name__ == "__main__":
    main()
