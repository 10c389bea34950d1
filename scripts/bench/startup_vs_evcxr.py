"""A kernel's start next to evcxr_jupyter's: each kernel started by a Jupyter client, alternating,
timed from the start request to "ready" (the kernel answered kernel_info) and to the end of a
first tch cell (evcxr_jupyter needs `:dep tch` first; tchmem's prelude has it). Prints medians
and the ratio tchmem / evcxr_jupyter."""

import statistics
import subprocess
import sys
import time

from jupyter_client.manager import start_new_kernel

from cell_overhead import run as run_cell

FIRST_CELL = "tch::Tensor::from_slice(&[1i64, 2]).sum(tch::Kind::Int64).int64_value(&[])"
SETUP = {"evcxr_jupyter": [':dep tch = "=0.24.0"'], "tchmem": []}


def start(name, spec):
    """One start: (seconds to ready, seconds to the first tch cell's end)."""
    began = time.perf_counter()
    km, kc = start_new_kernel(kernel_name=spec, startup_timeout=300,
                              stderr=subprocess.DEVNULL)
    ready = time.perf_counter() - began
    try:
        for code in SETUP[name]:
            run_cell(kc, code, timeout=1800)
        _, messages = run_cell(kc, FIRST_CELL, timeout=1800)
        results = [m["content"]["data"].get("text/plain") for m in messages
                   if m["msg_type"] == "execute_result"]
        if results != ["3"]:
            sys.exit(f"{name}: the first cell gave {results}, not 3")
        return ready, time.perf_counter() - began
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def main(repeats, evcxr_spec):
    kernels = {"evcxr_jupyter": evcxr_spec, "tchmem": "tchmem"}
    times = {name: [] for name in kernels}
    # One round not counted: evcxr_jupyter's first `:dep tch` ever compiles tch (minutes).
    for rep in range(-1, repeats):
        for name, spec in kernels.items():
            measured = start(name, spec)
            if rep >= 0:
                times[name].append(measured)
    print(f"median seconds over {repeats} starts each, alternating kernels (client side)")
    print(f"{'':<32} {'evcxr_jupyter':>13} {'tchmem':>8} {'ratio':>6}")
    for index, what in enumerate(["start to ready", "start to first tch cell's end"]):
        evcxr = statistics.median(t[index] for t in times["evcxr_jupyter"])
        ours = statistics.median(t[index] for t in times["tchmem"])
        print(f"{what:<32} {evcxr:13.2f} {ours:8.2f} {ours / evcxr:5.2f}x")
    print(f"tchmem's starts to the first tch cell's end: "
          f"{', '.join(f'{t[1]:.1f}' for t in times['tchmem'])} s (goal: <= 5 s)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5,
         sys.argv[2] if len(sys.argv) > 2 else "evcxr-bench")
