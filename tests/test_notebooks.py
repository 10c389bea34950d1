"""The tutorial notebooks, executed headless by nbclient through the installed kernelspec, and
`tchmem execute` (the same engine without Jupyter) on what a notebook run can meet. Each tutorial
also runs through `tchmem execute` in tests/test_offline.py (the offline bundle's), whose outputs
must be of the kinds nbclient's are."""

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import nbformat
import pytest

from conftest import FIRST_CELL_TIMEOUT, charts_in, executed_in_nbclient, tchmem_bin

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def all_text(notebook):
    return json.dumps([cell.get("outputs", []) for cell in notebook["cells"]])


def meant_to_fail(cell):
    return "raises-exception" in cell.metadata.get("tags", [])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_in_nbclient(path):
    notebook = executed_in_nbclient(path)
    nbformat.validate(notebook)
    errors = [o for cell in notebook.cells if not meant_to_fail(cell)
              for o in cell.get("outputs", []) if o["output_type"] == "error"]
    assert errors == []
    for cell in filter(meant_to_fail, notebook.cells):
        assert any(o["output_type"] == "error" for o in cell.outputs), cell.source


def test_hello_notebook_shows_its_results():
    notebook = executed_in_nbclient(NOTEBOOKS[0])
    assert NOTEBOOKS[0].name == "00-hello-tch.ipynb"
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert code[1].outputs[-1]["data"]["text/plain"] == "10.0"
    assert "loss: first step" in all_text(notebook)
    mimes = {m for c in code for o in c.outputs if o["output_type"] == "display_data"
             for m in o["data"]}
    assert {"text/html", "image/svg+xml", "application/vnd.tchmem.record+json"} <= mimes
    # The loss curve (an SVG) carries an image of itself, which JupyterLab shows untrusted too.
    curve = next(o["data"] for c in code for o in c.outputs if "image/svg+xml" in o.get("data", {}))
    assert charts_in(curve["text/html"]) == [curve["image/svg+xml"]]
    records = [o["data"]["application/vnd.tchmem.record+json"] for c in code for o in c.outputs
               if "application/vnd.tchmem.record+json" in o.get("data", {})]
    parameters = {c["name"]: c["bytes"] for c in records[-1]["categories"]}["parameters"]
    assert parameters == (1 + 1) * 4  # Linear(1, 1): one weight, one bias, f32
    # The learned parameters are read from the model (y = 3x - 1), not NaN.
    table = next(o["data"]["text/html"] for c in code for o in c.outputs
                 if "<th>parameter</th>" in o.get("data", {}).get("text/html", ""))
    learned = re.findall(r"<td>(weight|bias)</td><td>(-?[0-9.]+)</td>", table)
    assert [(name, round(float(value))) for name, value in learned] == [("weight", 3), ("bias", -1)]
    shape_error = next(c for c in code if "raises-exception" in c.metadata.get("tags", []))
    assert "cannot be multiplied" in shape_error.outputs[-1]["evalue"]


def test_tchmem_execute_stops_at_a_failing_cell_and_says_why(tmp_path):
    cells = [nbformat.v4.new_code_cell("let a = 1;"),
             nbformat.v4.new_code_cell('panic!("stop here")'),
             nbformat.v4.new_code_cell("a + 1")]
    notebook = nbformat.v4.new_notebook(cells=cells)
    src = tmp_path / "failing.ipynb"
    nbformat.write(notebook, src)
    out = tmp_path / "out.ipynb"
    run = subprocess.run([tchmem_bin(), "execute", str(src), "--output", str(out)],
                         capture_output=True, text=True, timeout=FIRST_CELL_TIMEOUT)
    assert run.returncode != 0
    assert "cell 2: Panic: stop here" in run.stderr
    executed = nbformat.read(out, as_version=4)
    assert executed.cells[1].outputs[-1]["output_type"] == "error"
    assert executed.cells[2].outputs == [] and executed.cells[2].execution_count is None

    run = subprocess.run([tchmem_bin(), "execute", str(src), "--output", str(out),
                          "--allow-errors"], capture_output=True, text=True,
                         timeout=FIRST_CELL_TIMEOUT)
    assert run.returncode != 0
    executed = nbformat.read(out, as_version=4)
    assert executed.cells[2].outputs[-1]["data"]["text/plain"] == "2"


def test_ctrl_c_in_tchmem_execute_stops_the_cell_at_a_loop_and_the_run(tmp_path):
    """As in a terminal: Ctrl-C reaches the whole process group (tchmem and the process that runs
    cells); the cell stops at a loop boundary, the live view was printed, no later cell runs."""
    cells = [nbformat.v4.new_code_cell("let mut n = 0u64;"),
             nbformat.v4.new_code_cell(
                 "loop {\n    n += 1;\n    std::thread::sleep(std::time::Duration::from_millis(10));\n}"),
             nbformat.v4.new_code_cell("n")]
    src, out = tmp_path / "long.ipynb", tmp_path / "out.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), src)
    run = subprocess.Popen([tchmem_bin(), "execute", str(src), "--output", str(out)],
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen = []
    for line in run.stderr:
        seen.append(line)
        if line.startswith("tchmem: running "):  # the live view, after the cell's first second
            break
    os.killpg(run.pid, signal.SIGINT)
    _, rest = run.communicate(timeout=60)
    stderr = "".join(seen) + rest
    assert run.returncode != 0, stderr
    assert "stopped by Ctrl-C" in stderr, stderr
    executed = nbformat.read(out, as_version=4)
    (error,) = [o for o in executed.cells[1].outputs if o["output_type"] == "error"]
    assert error["ename"] == "Interrupted" and "variables kept" in error["evalue"], error
    assert executed.cells[2].execution_count is None


def test_tchmem_execute_runs_past_cells_tagged_raises_exception(tmp_path):
    meant = nbformat.v4.new_code_cell('panic!("an example error")')
    meant.metadata["tags"] = ["raises-exception"]
    unmet = nbformat.v4.new_code_cell("1 + 1")
    unmet.metadata["tags"] = ["raises-exception"]
    cells = [meant, nbformat.v4.new_code_cell("2 + 2")]
    src, out = tmp_path / "tagged.ipynb", tmp_path / "out.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), src)
    run = subprocess.run([tchmem_bin(), "execute", str(src), "--output", str(out)],
                         capture_output=True, text=True, timeout=FIRST_CELL_TIMEOUT)
    assert run.returncode == 0, run.stderr
    executed = nbformat.read(out, as_version=4)
    assert executed.cells[0].outputs[-1]["ename"] == "Panic"
    assert executed.cells[1].outputs[-1]["data"]["text/plain"] == "4"

    nbformat.write(nbformat.v4.new_notebook(cells=[unmet]), src)
    run = subprocess.run([tchmem_bin(), "execute", str(src), "--output", str(out)],
                         capture_output=True, text=True, timeout=FIRST_CELL_TIMEOUT)
    assert run.returncode != 0
    assert "tagged raises-exception but ran without an error" in run.stderr


def test_tchmem_execute_rejects_what_is_not_a_notebook(tmp_path):
    bad = tmp_path / "bad.ipynb"
    bad.write_text("{ not json")
    run = subprocess.run([tchmem_bin(), "execute", str(bad)], capture_output=True, text=True)
    assert run.returncode != 0 and "not a notebook" in run.stderr


def test_rewritten_code_is_a_monospace_block_in_static_html(tmp_path):
    """The committed tutorial (with its H200 outputs) as nbconvert renders it for a static page:
    the code %%optimize shows is a preformatted block, not running text."""
    from nbconvert import HTMLExporter

    notebook = nbformat.read(Path(__file__).parent.parent / "notebooks" /
                             "03-making-it-fit.ipynb", as_version=4)
    html, _ = HTMLExporter().from_notebook_node(notebook)
    blocks = re.findall(r"<pre>(.*?)</pre>", html, flags=re.S)
    rewritten = [b for b in blocks if "rewritten by tchmem" in b]
    assert rewritten, "no rewritten code in a <pre> block"
    # The whole rewritten loop is inside the block, its lines kept.
    text = [re.sub(r"<[^>]+>", "", b) for b in rewritten]
    assert all("for " in t and "VarStore::new" in t and t.count("\n") > 10 for t in text), text
