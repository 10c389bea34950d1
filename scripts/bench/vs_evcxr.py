"""Cell latency next to evcxr_jupyter: the same cells in both kernels, alternating one by one in
one run, timed from the client (request to idle: compile, load, run, reply). Every repetition
changes a literal so that no kernel can answer from a cache of compiled cells. Prints the median
per cell and kernel and their ratio (tchmem / evcxr_jupyter; goal <= 1.0)."""

import statistics
import subprocess
import sys
import time

from jupyter_client.manager import start_new_kernel

from cell_overhead import run as run_cell

# Steady-state cells, as a notebook user types them (evcxr needs tch as a :dep; tchmem's
# prelude has it).
SETUP_EVCXR = ':dep tch = "=0.24.0"'
SETUP = "let x = 5;"
CELLS = {
    "1 + 1": "1 + {i}",
    "let x = 5;": "let x = {i};",
    "x * 2": "x * {i}",
    "use line": "use std::collections::BTreeMap as Map{i};",
    "let tensor": "let t = tch::Tensor::ones([{n}], tch::kind::FLOAT_CPU);",
    "tensor sum": "tch::Tensor::ones([1000], tch::kind::FLOAT_CPU)"
                  ".sum(tch::Kind::Float).double_value(&[]) + {i}.0",
    "VarStore + linear": "let vs = tch::nn::VarStore::new(tch::Device::Cpu);\n"
                         "let lin = tch::nn::linear(vs.root(), 64, {n}, Default::default());",
    "fn + loop": "fn square(v: i64) -> i64 {{ v * v }}\n"
                 "let mut total = 0;\nfor k in 0..{n} {{ total += square(k); }}\ntotal",
}


def run(kc, code):
    """Executes `code`; returns seconds from request to idle. Exits on a failed cell. (The first
    evcxr cell compiles tch: minutes.)"""
    seconds, _ = run_cell(kc, code, timeout=1800)
    return seconds


def main(repeats, evcxr_kernel):
    kernels = {}
    for name, spec, setup in (("evcxr_jupyter", evcxr_kernel, [SETUP_EVCXR, SETUP]),
                              ("tchmem", "tchmem", [SETUP])):
        started = time.perf_counter()
        km, kc = start_new_kernel(kernel_name=spec, startup_timeout=300,
                                  stderr=subprocess.DEVNULL)
        for code in setup:
            run(kc, code)
        print(f"{name}: started and set up in {time.perf_counter() - started:.1f} s",
              file=sys.stderr)
        kernels[name] = kc
        kernels[name + "/manager"] = km
    names = ["evcxr_jupyter", "tchmem"]
    times = {(cell, name): [] for cell in CELLS for name in names}
    # One warm-up round that is not counted (first compile of each cell shape).
    for rep in range(-1, repeats):
        for cell, template in CELLS.items():
            for name in names:
                code = template.format(i=rep + 2, n=64 + rep + 2)
                seconds = run(kernels[name], code)
                if rep >= 0:
                    times[(cell, name)].append(seconds)
    for name in names:
        kernels[name].stop_channels()
        kernels[name + "/manager"].shutdown_kernel(now=True)

    print(f"median seconds per cell over {repeats} repetitions, alternating kernels "
          f"(request to idle)")
    print(f"{'cell':<20} {'evcxr_jupyter':>13} {'tchmem':>8} {'ratio':>6}")
    ratios = []
    for cell in CELLS:
        evcxr = statistics.median(times[(cell, "evcxr_jupyter")])
        ours = statistics.median(times[(cell, "tchmem")])
        ratios.append(ours / evcxr)
        print(f"{cell:<20} {evcxr:13.3f} {ours:8.3f} {ours / evcxr:5.2f}x")
    print(f"worst ratio {max(ratios):.2f}x (goal <= 1.00x), "
          f"geometric mean {statistics.geometric_mean(ratios):.2f}x")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10,
         sys.argv[2] if len(sys.argv) > 2 else "evcxr-bench")
