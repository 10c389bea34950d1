"""The kernel on a machine without network, prepared the documented way: scripts/offline-pack
where there is network, then the bundle's `install` and every tutorial through `tchmem execute`
inside a network namespace that has no network at all (`unshare -n`, as root), with a fresh
cargo home and compile directory. Every cell that works online must work there, including the
ones whose variable types the engine's code analysis has to work out from tch and the standard
library."""

import os
import re
import subprocess
from datetime import datetime
from pathlib import Path

import nbformat
import pytest

from conftest import FIRST_CELL_TIMEOUT, executed_in_nbclient, output_types, tchmem_bin

REPO = Path(__file__).parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
BENCH_OUT = REPO / "build" / "bench-offline.txt"


def offline(command, env, timeout):
    """Runs `command` in a new network namespace with only a loopback interface."""
    script = 'ip link set lo up 2>/dev/null; exec "$@"'
    return subprocess.run(["unshare", "-n", "bash", "-c", script, "offline", *command],
                          env=env, capture_output=True, text=True, timeout=timeout)


def write_notebook(path, cells):
    """A notebook of code cells at `path`."""
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells]),
                   path)
    return path


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("offline")
    subprocess.run([REPO / "scripts" / "offline-pack", root / "bundle"], check=True,
                   timeout=900)
    env = dict(os.environ)
    env.update(CARGO_HOME=str(root / "cargo-home"), TCHMEM_WORKDIR=str(root / "slots"))
    probe = offline(["true"], env, 60)
    assert probe.returncode == 0, f"cannot make a network namespace (unshare -n needs root): " \
                                  f"{probe.stderr}"
    install = offline([root / "bundle" / "install", "--prefix", root / "jupyter",
                       "--libtorch", os.environ["LIBTORCH"]], env, FIRST_CELL_TIMEOUT)
    assert install.returncode == 0, install.stdout + install.stderr
    return root, env, install


def cell_seconds(notebook):
    times = []
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        timing = cell.metadata.get("execution", {})
        start, end = timing.get("shell.execute_reply.started"), timing.get("shell.execute_reply")
        times.append((datetime.fromisoformat(end) - datetime.fromisoformat(start))
                     .total_seconds() if start and end else None)
    return times


def test_the_offline_install_builds_the_compile_slot_and_points_cargo_at_the_bundle(bundle):
    root, env, install = bundle
    assert "compile slot" in install.stdout and "ready" in install.stdout
    config = (root / "cargo-home" / "config.toml").read_text()
    assert f'directory = "{root / "bundle" / "vendor"}"' in config
    assert "net.offline = true" in config
    # The standard library's workspace dependencies are in the bundle too (for an analysis told
    # to read the library's workspace, see the test below).
    vendored = {p.name.rsplit("-", 1)[0] for p in (root / "bundle" / "vendor").iterdir()}
    assert {"tch", "torch-sys", "addr2line", "hashbrown", "compiler_builtins"} - vendored \
        <= {"compiler_builtins"}  # a path crate of the library in recent toolchains


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_tutorial_cell_runs_offline_as_in_nbclient(bundle, path):
    """Through `tchmem execute`, offline: no error but where a cell is meant to fail, and each
    cell's outputs of the kinds the same notebook has in nbclient through the installed
    kernelspec (tests/test_notebooks.py checks that run's outputs)."""
    root, env, _ = bundle
    out = root / f"{path.stem}.offline.ipynb"
    run = offline([root / "bundle" / "bin" / "tchmem", "execute", path, "--output", out],
                  env, FIRST_CELL_TIMEOUT)
    assert run.returncode == 0, run.stderr[-4000:]
    notebook = nbformat.read(out, as_version=4)
    nbformat.validate(notebook)
    errors = [o for c in notebook.cells if "raises-exception" not in c.metadata.get("tags", [])
              for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert errors == []
    assert output_types(notebook) == output_types(executed_in_nbclient(path))


def test_type_inference_offline_matches_online(bundle, tmp_path):
    """Cells whose persisted variables need inferred types: a tuple from a fold over a Vec of
    f64 (the standard library) and an optimizer built from tch's builder (tch)."""
    root, env, _ = bundle
    cells = ["let logs: Vec<f64> = vec![3.0, 1.0, 2.0];",
             "let (lo, hi) = logs.iter().fold((f64::MAX, f64::MIN), "
             "|(lo, hi), &x| (lo.min(x), hi.max(x)));",
             "use tch::nn::OptimizerConfig;\nlet vs = tch::nn::VarStore::new(tch::Device::Cpu);\n"
             "let lin = tch::nn::linear(vs.root(), 2, 1, Default::default());\n"
             "let mut opt = tch::nn::Adam::default().build(&vs, 1e-2).unwrap();",
             "opt.set_lr(1e-3); (lo, hi)"]
    src = write_notebook(tmp_path / "infer.ipynb", cells)
    run = offline([root / "bundle" / "bin" / "tchmem", "execute", src, "--output",
                   tmp_path / "out.ipynb"], env, FIRST_CELL_TIMEOUT)
    assert run.returncode == 0, run.stderr[-4000:]
    last = nbformat.read(tmp_path / "out.ipynb", as_version=4).cells[-1]
    assert last.outputs[-1]["data"]["text/plain"] == "(1.0, 3.0)"


def test_without_the_standard_librarys_workspace_crates_std_is_still_known(bundle, tmp_path):
    """With the crates of the standard library's own workspace taken out of the bundle (what an
    offline machine has without them), the code analysis still knows std: it reads the library's
    crates, not its workspace (src/session/analysis_std.rs), and types `lo`, `hi` and `words`.
    Told to read the workspace (`RUST_SRC_PATH` set to the toolchain's library, which the kernel
    respects), the analysis loses std offline: the kernel asks the compiler and runs the cells."""
    root, env, _ = bundle
    vendor, aside = root / "bundle" / "vendor", tmp_path / "aside"
    lock = next((root / "slots").glob("slot-*/Cargo.lock")).read_text()
    needed = {f"{n}-{v}" for n, v in re.findall(r'name = "([^"]+)"\nversion = "([^"]+)"', lock)}
    aside.mkdir()
    moved = [p for p in vendor.iterdir() if p.name not in needed]
    assert moved, "the bundle should hold crates only the standard library uses"
    sysroot = subprocess.run(["rustc", "--print", "sysroot"], env=env, capture_output=True,
                             text=True, check=True).stdout.strip()
    workspace = dict(env, RUST_SRC_PATH=f"{sysroot}/lib/rustlib/src/rust/library")
    cells = ["let logs: Vec<f64> = vec![3.0, 1.0, 2.0];",
             "let (lo, hi) = logs.iter().fold((f64::MAX, f64::MIN), "
             "|(lo, hi), &x| (lo.min(x), hi.max(x)));\n"
             "let words = \"a b\".split(' ').map(String::from).collect::<Vec<_>>();",
             "(lo, hi, words.len())"]
    src = write_notebook(tmp_path / "fallback.ipynb", cells)
    for path in moved:
        path.rename(aside / path.name)
    try:
        runs = {name: offline([root / "bundle" / "bin" / "tchmem", "execute", src, "--output",
                               tmp_path / f"{name}.ipynb"], run_env, FIRST_CELL_TIMEOUT)
                for name, run_env in [("crates", env), ("workspace", workspace)]}
    finally:
        for path in moved:
            (aside / path.name).rename(path)
    for name, run in runs.items():
        assert run.returncode == 0, (name, run.stderr[-4000:])
        out = nbformat.read(tmp_path / f"{name}.ipynb", as_version=4)
        assert out.cells[-1].outputs[-1]["data"]["text/plain"] == "(1.0, 3.0, 2)"
        notes = [o.get("text", "") for o in out.cells[1].outputs]
        named = any("the compiler names `(lo, hi): (f64, f64)`" in n for n in notes)
        assert named == (name == "workspace"), (name, notes)


def test_benchmark_cell_times_offline_next_to_online(bundle, tmp_path):
    """Not a timed test: prints (and writes to build/bench-offline.txt) each cell's time of the
    first tutorial, online through the default compile slots and offline through the bundle's.
    Both slots are built already (scripts/setup's and the bundle install's `tchmem prepare`), and
    both have run the tutorial in this session when the whole suite runs."""
    root, env, _ = bundle
    path = NOTEBOOKS[0]
    times = {}
    for side in ("online", "offline"):
        out = tmp_path / f"{side}.ipynb"
        command = [tchmem_bin() if side == "online" else root / "bundle" / "bin" / "tchmem",
                   "execute", path, "--output", out]
        result = (subprocess.run(command, capture_output=True, text=True,
                                 timeout=FIRST_CELL_TIMEOUT) if side == "online"
                  else offline(command, env, FIRST_CELL_TIMEOUT))
        assert result.returncode == 0, result.stderr[-4000:]
        times[side] = cell_seconds(nbformat.read(out, as_version=4))
    lines = [f"{path.name}: seconds per cell, offline (bundle, no network) next to online",
             f"{'cell':>4} {'online':>8} {'offline':>8} {'ratio':>6}"]
    for i, (on, off) in enumerate(zip(times["online"], times["offline"]), 1):
        lines.append(f"{i:>4} {on:>8.2f} {off:>8.2f} {off / on:>6.2f}")
    total_on, total_off = sum(times["online"]), sum(times["offline"])
    lines.append(f"{'all':>4} {total_on:>8.2f} {total_off:>8.2f} {total_off / total_on:>6.2f}"
                 "   (goal: offline within 1.2x)")
    report = "\n".join(lines)
    print("\n" + report)
    BENCH_OUT.parent.mkdir(exist_ok=True)
    BENCH_OUT.write_text(report + "\n")
    assert len(times["online"]) == len(times["offline"]) > 0
