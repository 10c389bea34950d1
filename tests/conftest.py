"""Shared set-up for the tests that drive a real tchmem kernel through real Jupyter clients.

The kernel binary comes from $TCHMEM_BIN (scripts/test sets it). A kernelspec named
"tchmem-test" is installed into a temporary prefix that JUPYTER_PATH puts first, so that no other
installed tchmem kernelspec can be picked up by mistake."""

import base64
import copy
import functools
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import nbformat
import pytest
from jupyter_client.manager import start_new_kernel
from nbclient import NotebookClient

KERNEL_NAME = "tchmem-test"
# The first cell of a kernel waits for the prelude (tch) to compile: minutes on a cold machine.
FIRST_CELL_TIMEOUT = 900
CELL_TIMEOUT = 120

_prefix = Path(tempfile.mkdtemp(prefix="tchmem-kernelspec-"))

LIVE_MIME = "application/vnd.tchmem.live+json"


def tchmem_bin() -> str:
    path = os.environ.get("TCHMEM_BIN")
    if not path or not Path(path).is_file():
        raise RuntimeError("set TCHMEM_BIN to the built tchmem binary (scripts/test does)")
    return path


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    subprocess.run(
        [tchmem_bin(), "install", "--prefix", str(_prefix), "--name", KERNEL_NAME],
        check=True,
    )
    os.environ["JUPYTER_PATH"] = str(_prefix / "share" / "jupyter")


def pytest_unconfigure(config):
    shutil.rmtree(_prefix, ignore_errors=True)


def execute(kc, code, timeout=CELL_TIMEOUT, **kwargs):
    """Runs `code`; returns (reply content, iopub messages of this request up to idle)."""
    reply, _, messages = wait_for(kc, kc.execute(code, **kwargs), timeout)
    return reply, messages


def wait_for(kc, msg_id, timeout=CELL_TIMEOUT):
    """The reply to request `msg_id`, when it came (time.monotonic()), and the request's iopub
    messages up to idle."""
    reply = kc.get_shell_msg(timeout=timeout)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kc.get_shell_msg(timeout=timeout)
    replied = time.monotonic()
    messages = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        messages.append(msg)
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return reply["content"], replied, messages


def complete(kc, code, timeout=CELL_TIMEOUT):
    """Asks for completions at the end of `code`; returns the reply's content."""
    msg_id = kc.complete(code, len(code))
    reply = kc.get_shell_msg(timeout=timeout)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kc.get_shell_msg(timeout=timeout)
    return reply["content"]


def outputs(messages, msg_type):
    return [m["content"] for m in messages if m["msg_type"] == msg_type]


# What %memestimate shows (as JSON) beside its text.
ESTIMATE_MIME = "application/vnd.tchmem.estimate+json"


def displayed(messages, mime):
    """What `mime` shows: in new displays, or in displays replaced in place (live tables)."""
    shown = outputs(messages, "display_data") + outputs(messages, "update_display_data")
    return [d["data"][mime] for d in shown if mime in d["data"]]


def charts_in(html):
    """The SVG documents of the charts in an output's HTML: tchmem draws each as an image whose
    source is the SVG (src/report/embed.rs), which notebooks show trusted or not."""
    found = re.findall(r'src="data:image/svg\+xml;base64,([^"]+)"', html)
    return [base64.b64decode(data).decode() for data in found]


def stream_text(messages, name="stdout"):
    return "".join(c["text"] for c in outputs(messages, "stream") if c["name"] == name)


def result_text(messages):
    results = outputs(messages, "execute_result")
    return results[-1]["data"]["text/plain"] if results else None


def page_text(reply):
    """The help a reply sends to the frontend's pager (its `page` payload), or ''."""
    pages = [p for p in reply.get("payload", []) if p.get("source") == "page"]
    return "".join(p["data"].get("text/plain", "") for p in pages)


_has_cuda = {}


def kernel_has_cuda(kc):
    """Whether the kernel's cells see a CUDA device (false in CI). Asked once per kernel, so that
    tests about the last cell's record are not disturbed by the question."""
    if id(kc) not in _has_cuda:
        reply, messages = execute(kc, "tch::Cuda::is_available()")
        assert reply["status"] == "ok", reply
        _has_cuda[id(kc)] = result_text(messages) == "true"
    return _has_cuda[id(kc)]


def skip_on_cuda(kc):
    """For tests of the CPU records, whose cells would show the GPU's where there is one (the GPU's
    are tests/test_gpu.py's)."""
    if kernel_has_cuda(kc):
        pytest.skip("asserts the CPU records; on CUDA tests/test_gpu.py checks the GPU's")


@pytest.fixture(scope="module")
def kernel():
    """A started kernel whose prelude is compiled: (KernelManager, BlockingKernelClient)."""
    km, kc = start_new_kernel(kernel_name=KERNEL_NAME, startup_timeout=120)
    reply, _ = execute(kc, "1", timeout=FIRST_CELL_TIMEOUT)
    assert reply["status"] == "ok", reply
    yield km, kc
    kc.stop_channels()
    km.shutdown_kernel(now=False)


@functools.cache
def _executed_in_nbclient(path):
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, kernel_name=KERNEL_NAME, timeout=FIRST_CELL_TIMEOUT,
                   startup_timeout=120).execute()
    return notebook


def executed_in_nbclient(path):
    """The notebook at `path` as nbclient executed it through the installed kernelspec, run once
    per test session: the notebook suite checks its outputs, the offline suite compares its own
    run (`tchmem execute` through the bundle) with it."""
    return copy.deepcopy(_executed_in_nbclient(Path(path)))


def output_types(notebook):
    """Each code cell's output types, consecutive streams counted as one (nbclient keeps the
    stream messages apart that `tchmem execute` joins, as frontends show them). A live view is
    left out: whether a cell runs past its first second depends on the machine's load, so a
    cell near a second has one in one run and none in the other."""
    types = []
    for cell in notebook["cells"]:
        if cell["cell_type"] != "code":
            continue
        kinds = []
        for output in cell.get("outputs", []):
            if LIVE_MIME in output.get("data", {}):
                continue
            kind = output["output_type"]
            if not (kind == "stream" and kinds and kinds[-1] == "stream"):
                kinds.append(kind)
        types.append(kinds)
    return types
