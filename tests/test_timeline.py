"""Allocation timelines from traces recorded on the H200 (tests/fixtures/timeline/, made by
`timeline_bench fixture`): the kernel's renderer draws them, and the snapshot it hands on is one
that PyTorch's own torch.cuda._memory_viz reads, with the same events the inline view counts.
The magics' CPU behaviour (no CUDA: a clear note, nothing lost) is tested through a kernel."""

import pickle
import re
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conftest import execute, outputs, stream_text, tchmem_bin

FIXTURES = Path(__file__).parent / "fixtures" / "timeline"


def render(capture, tmp_path, *extra):
    svg = tmp_path / "timeline.svg"
    done = subprocess.run(
        [tchmem_bin(), "timeline", str(capture), "-o", str(svg), *extra],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout, svg.read_text()


@pytest.mark.parametrize("name", ["trace", "stacks"])
def test_an_h200_trace_renders_as_valid_svg_with_every_category(name, tmp_path):
    text, svg = render(FIXTURES / f"{name}.json", tmp_path)
    root = ET.fromstring(svg)  # valid XML
    assert root.tag.endswith("svg")
    titles = [t.text for t in root.iter() if t.tag.endswith("title")]
    assert len(titles) > 100, "every column has hover text"
    for label in ["parameters", "gradients", "optimizer state", "activations", "cache"]:
        assert label in svg, f"{label} missing from the chart"
    assert re.search(r"peak [\d.]+ [KMG]iB allocated at [\d.]+ ms", text), text
    assert len(svg) < 500_000


def test_the_snapshot_loads_in_pytorchs_memory_viz_with_the_events_the_view_counts(tmp_path):
    from torch.cuda import _memory_viz

    copy = tmp_path / "copy.pickle"
    text, _ = render(FIXTURES / "trace.json", tmp_path, "--snapshot", str(copy))
    allocs, frees = map(int, re.search(r"(\d+) allocations and (\d+) frees", text).groups())
    with open(copy, "rb") as f:
        snapshot = pickle.load(f)
    trace = [e for t in snapshot["device_traces"] for e in t]
    assert sum(e["action"] == "alloc" for e in trace) == allocs
    assert sum(e["action"] == "free_completed" for e in trace) == frees
    # PyTorch's own viewer functions accept it.
    html = _memory_viz.trace_plot(snapshot)
    assert "<html" in html.lower() or "<script" in html.lower()
    assert _memory_viz.segment_plot(snapshot)
    phases = {e.get("user_metadata") for e in trace}
    assert {"tchmem:forward", "tchmem:backward", "tchmem:step"} <= phases


def test_stack_frames_name_functions(tmp_path):
    with open(FIXTURES / "stacks.pickle", "rb") as f:
        snapshot = pickle.load(f)
    frames = [fr for t in snapshot["device_traces"] for e in t for fr in e.get("frames", [])]
    assert frames, "the stacks fixture has frames"


@pytest.fixture
def kernel():
    from jupyter_client.manager import start_new_kernel
    from conftest import KERNEL_NAME, FIRST_CELL_TIMEOUT

    km, kc = start_new_kernel(kernel_name=KERNEL_NAME, startup_timeout=120)
    execute(kc, "1", timeout=FIRST_CELL_TIMEOUT)
    yield kc
    kc.stop_channels()
    km.shutdown_kernel(now=True)


def test_memsnapshot_before_any_profile_is_a_clear_error(kernel):
    reply, _ = execute(kernel, "%memsnapshot /tmp/tchmem-nothing.pickle")
    assert reply["status"] == "error" and "%%memprofile first" in reply["evalue"], reply


def test_memprofile_without_cuda_says_why_and_the_cell_still_runs(kernel):
    reply, messages = execute(kernel, "%%memprofile --steps 1\nlet kept = 41 + 1;\nprintln!(\"{kept}\");")
    assert reply["status"] == "ok", reply
    streams = "".join(c["text"] for c in outputs(messages, "stream"))
    assert "42" in streams
    shown = " ".join(
        c["data"].get("text/plain", "") for c in outputs(messages, "display_data")
    )
    assert "no timeline" in shown and "CUDA" in shown, shown
    reply, messages = execute(kernel, "kept + 1")
    assert reply["status"] == "ok"
    reply, messages = execute(kernel, "%memsnapshot /tmp/tchmem-nothing.pickle")
    assert reply["status"] == "ok", reply
    assert "nothing written" in "".join(c["text"] for c in outputs(messages, "stream"))
    reply, _ = execute(kernel, "%%memprofile --steps 0\nlet a = 1;")
    assert reply["status"] == "error" and "--steps" in reply["evalue"]
    reply, _ = execute(kernel, "%%memprofile\n%%optimize --checkpoint --compare 2\nlet a = 1;")
    assert reply["status"] == "error" and "--compare" in reply["evalue"]


PROBE = """
fn where_am_i() -> Vec<tchmem::timeline::StackFrame> {
    tchmem::timeline::stack_frames("fast").unwrap()
}
{
    let frames = where_am_i();
    let mine = frames.iter().find(|f| f.function.contains("where_am_i")).unwrap();
    println!("{}\\t{}", mine.file, mine.line);
}
"""


def test_with_stacks_cells_have_line_tables_that_libtorchs_symbolizer_reads(kernel):
    # libtorch's unwinder and symbolizer (the ones its allocation history uses) on CPU: under
    # --stacks a cell's frames name the generated crate's source and a line; without, only the
    # cell's library and an offset into it.
    reply, messages = execute(kernel, "%%memprofile --stacks" + PROBE)
    assert reply["status"] == "ok", (reply.get("evalue"), reply.get("traceback"))
    file, line = [l for l in stream_text(messages).splitlines() if "\t" in l][-1].split("\t")
    assert "src/lib.rs".endswith(file) or file.endswith("/src/lib.rs"), file
    assert 0 < int(line) < 1000, line
    reply, messages = execute(kernel, PROBE)
    assert reply["status"] == "ok", reply
    file, _ = [l for l in stream_text(messages).splitlines() if "\t" in l][-1].split("\t")
    assert file.endswith(".so"), file
