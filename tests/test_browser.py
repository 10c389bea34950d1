"""A tutorial as a user meets it: JupyterLab in headless Chromium (driven by playwright) opens a
tutorial with its outputs cleared, runs every cell through the kernel, and the test reads what the
page shows: no unexpected error, the charts drawn, a completion popup for a half-typed name.
Screenshots are kept under build/browser/ (CI keeps build/ as its artifacts).

Needs Chromium (scripts/test installs Debian's) and the venv's jupyterlab and playwright; the test
is skipped, saying why, where either is missing."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from conftest import KERNEL_NAME

ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "build" / "browser"
CHROMIUM = os.environ.get("TCHMEM_CHROMIUM", "/usr/lib/chromium/chromium")
# The probe's flags: a closed network refuses Chromium's background connections otherwise.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
RUN_TIMEOUT = 900

playwright_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
if not Path(CHROMIUM).is_file():
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on localhost (no token) whose root holds the tutorials, outputs
    cleared and their kernel set to the test kernelspec; yields (base url, root)."""
    root = tmp_path_factory.mktemp("lab")
    for path in (ROOT / "notebooks").glob("*.ipynb"):
        notebook = nbformat.read(path, as_version=4)
        for cell in notebook.cells:
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        notebook.metadata["kernelspec"]["name"] = KERNEL_NAME
        nbformat.write(notebook, root / path.name)
    # Settings of its own: no news prompt over the page, nothing read from the user's settings.
    settings = root / ".settings"
    (settings / "@jupyterlab" / "apputils-extension").mkdir(parents=True)
    (settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings") \
        .write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    # Every cell in the page (no windowing), so that every output can be found and measured.
    (settings / "@jupyterlab" / "notebook-extension").mkdir(parents=True)
    (settings / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings") \
        .write_text(json.dumps({"windowingMode": "none"}))
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", f"--port={port}",
         "--ServerApp.ip=127.0.0.1", "--IdentityProvider.token=", "--ServerApp.password=",
         "--LabApp.expose_app_in_browser=True", f"--LabApp.user_settings_dir={settings}",
         f"--ServerApp.root_dir={root}"],
        stdout=subprocess.DEVNULL, stderr=open(root / "server.log", "w"))
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(f"{base}/api/status", timeout=2)
            break
        except OSError:
            if time.time() > deadline or server.poll() is not None:
                server.kill()
                pytest.fail(f"JupyterLab did not start:\n{(root / 'server.log').read_text()}")
            time.sleep(0.5)
    yield base, root
    server.terminate()
    server.wait(timeout=30)


@pytest.fixture(scope="module")
def page():
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        yield context.new_page()
        browser.close()


# JavaScript run in the page: the state of the open notebook, read from JupyterLab's own model
# (exposed by --LabApp.expose_app_in_browser).
NOTEBOOK_STATE = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  const cells = panel.content.widgets.filter(c => c.model.type === 'code');
  return {
    kernel: panel.sessionContext.session?.kernel?.status ?? 'none',
    cells: cells.map(c => ({
      count: c.model.executionCount,
      tags: c.model.getMetadata('tags') ?? [],
      outputs: c.model.outputs.toJSON().map(o => {
        if (o.output_type === 'error') return {type: 'error', text: o.ename + ': ' + o.evalue};
        // JupyterLab renders an output's HTML where it has HTML and an SVG (tchmem adds the
        // SVG as an HTML image): its charts are those of the HTML, else the SVG.
        const html = ((o.data ?? {})['text/html'] ?? '').toString();
        const inHtml = html.split('<svg').length - 1 + html.split('src="data:image/svg+xml').length - 1;
        return {type: o.output_type, mimes: Object.keys(o.data ?? {}),
                svgs: html ? inHtml : ('image/svg+xml' in (o.data ?? {}) ? 1 : 0)};
      }),
    })),
  };
}"""


# Charts in outputs: SVG images (tchmem's HTML summaries draw theirs as images whose source is
# the SVG; image/svg+xml outputs) or inline SVG (others' HTML).
CHART_SELECTOR = (".jp-OutputArea-output svg:not(svg svg), "
                  ".jp-OutputArea-output img[src^='data:image/svg']")
# The charts the page draws: their width on screen and their smallest text in screen pixels.
CHARTS_ON_PAGE = """() => {
  const CHART_SELECTOR = """ + json.dumps(CHART_SELECTOR) + """;
  const charts = [...document.querySelectorAll(CHART_SELECTOR)]
    .filter(el => !el.parentElement.closest('svg'));
  return charts.map(el => {
    const box = el.getBoundingClientRect();
    let smallest = null;
    if (el.tagName.toLowerCase() === 'svg') {
      const drawn = el.viewBox.baseVal?.width || el.width.baseVal.value || box.width;
      const scale = box.width / drawn;
      for (const text of el.querySelectorAll('text')) {
        const px = parseFloat(getComputedStyle(text).fontSize) * scale;
        if (text.textContent.trim() && (smallest === null || px < smallest)) smallest = px;
      }
    } else if (el.src.startsWith('data:image/svg+xml;base64,') && el.naturalWidth > 0) {
      // An image of an SVG: its text as drawn (font-size attributes) at the page's scale.
      const bytes = Uint8Array.from(atob(el.src.split(',')[1]), c => c.charCodeAt(0));
      const svg = new DOMParser().parseFromString(new TextDecoder().decode(bytes), 'image/svg+xml');
      const scale = box.width / el.naturalWidth;
      for (const text of svg.querySelectorAll('text[font-size]')) {
        const px = parseFloat(text.getAttribute('font-size')) * scale;
        if (text.textContent.trim() && (smallest === null || px < smallest)) smallest = px;
      }
    }
    return {width: box.width, smallest_text_px: smallest};
  });
}"""


def shut_down_kernels(page):
    """Ends every kernel the page started, so that the next notebook's kernel gets the prepared
    compile slot (a kernel still holding it would make the next one build a new slot)."""
    page.evaluate("() => window.jupyterapp.serviceManager.sessions.shutdownAll()")


def start_all(page, base, name):
    """Opens notebook `name` and, once its kernel is idle, runs all its cells."""
    # ?reset: a fresh workspace, which does not reopen (and start kernels for) earlier notebooks.
    page.goto(f"{base}/lab/tree/{name}?reset")
    page.wait_for_function("() => window.jupyterapp?.shell.currentWidget?.content?.widgets",
                           timeout=120_000)
    page.wait_for_function(
        "() => window.jupyterapp.shell.currentWidget.sessionContext.session?.kernel?.status"
        " === 'idle'", timeout=300_000)
    # Not awaited: the command's promise settles only when every cell has run.
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")


def run_all(page, base, name):
    start_all(page, base, name)
    deadline = time.time() + RUN_TIMEOUT
    while time.time() < deadline:
        state = page.evaluate(NOTEBOOK_STATE)
        if state["kernel"] == "idle" and all(c["count"] for c in state["cells"]):
            return state
        time.sleep(1)
    page.screenshot(path=str(SHOTS / f"{name}.timeout.png"), full_page=True)
    pytest.fail(f"{name}: not every cell ran within {RUN_TIMEOUT} s: {json.dumps(state)[:2000]}")


@pytest.mark.parametrize("name", ["00-hello-tch.ipynb", "01-where-does-memory-go.ipynb"])
def test_tutorial_runs_in_jupyterlab_and_its_charts_render(lab, page, name):
    base, _ = lab
    SHOTS.mkdir(parents=True, exist_ok=True)
    try:
        check_tutorial(page, base, name)
    finally:
        shut_down_kernels(page)


def check_tutorial(page, base, name):
    state = run_all(page, base, name)

    unexpected = [(i, o["text"]) for i, c in enumerate(state["cells"]) for o in c["outputs"]
                  if o["type"] == "error" and "raises-exception" not in c["tags"]]
    assert not unexpected, f"error cells: {unexpected}"
    charts_in_model = sum(o["svgs"] for c in state["cells"] for o in c["outputs"]
                          if o["type"] != "error")
    assert charts_in_model > 0, "the tutorial drew no chart"
    # What the page shows: every chart drawn (inline SVG in HTML, or an SVG image), at a useful
    # width, with text a reader can read (font size times the scale the page draws it at).
    # Chart images decode after the page has them: their text is read once they have.
    page.wait_for_function("() => [...document.querySelectorAll(\"img[src^='data:image/svg']\")]"
                           ".every(img => img.complete)", timeout=30_000)
    charts = page.evaluate(CHARTS_ON_PAGE)
    assert len(charts) >= charts_in_model, f"{charts_in_model} charts made, {len(charts)} shown"
    assert all(c["width"] >= 300 for c in charts), charts
    text_sizes = [c["smallest_text_px"] for c in charts if c["smallest_text_px"] is not None]
    assert text_sizes, f"no chart text found: {charts}"
    assert min(text_sizes) >= 11.5, f"chart text drawn at {min(text_sizes):.1f} px: {charts}"
    # The page and each chart as a reader sees them (kept under build/browser/).
    stem = name.removesuffix(".ipynb")
    page.screenshot(path=str(SHOTS / f"{stem}.png"))
    chart_elements = page.locator(CHART_SELECTOR)
    for i in range(chart_elements.count()):
        chart = chart_elements.nth(i)
        chart.scroll_into_view_if_needed()
        chart.screenshot(path=str(SHOTS / f"{stem}.chart-{i + 1}.png"))


def test_completion_pops_up_in_jupyterlab(lab, page):
    """JupyterLab drops completion answers slower than 1 s: the popup shows only when the kernel
    answers in time. As a user: open a notebook, run it, read for a moment, type, press Tab."""
    base, root = lab
    SHOTS.mkdir(parents=True, exist_ok=True)
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell("let start = tch::Tensor::ones([2], tch::kind::FLOAT_CPU);")]
    notebook.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": "tchmem",
                                       "language": "rust"}
    nbformat.write(notebook, root / "completion.ipynb")
    try:
        run_all(page, base, "completion.ipynb")
        time.sleep(10)
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:insert-cell-below')")
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:enter-edit-mode')")
        page.keyboard.type("let zz = tch::Tensor::zer")
        page.keyboard.press("Tab")
        completer = page.locator(".jp-Completer")
        completer.wait_for(state="visible", timeout=5_000)
        items = completer.locator(".jp-Completer-match").all_inner_texts()
        page.screenshot(path=str(SHOTS / "completion.png"))
        assert any(item.strip().startswith("zeros") for item in items), items[:20]
        box = completer.bounding_box()
        assert box["width"] <= 1280, f"the popup is wider than the window: {box}"
    finally:
        shut_down_kernels(page)


def test_live_view_updates_and_the_stop_button_keeps_the_variables(lab, page):
    """A long cell as a user meets it: the view under it changes while it runs, the stop button
    ends it with the loop's variables kept, and a new cell reads them."""
    base, root = lab
    SHOTS.mkdir(parents=True, exist_ok=True)
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell("let mut steps_done: Vec<u64> = Vec::new();"),
        nbformat.v4.new_code_cell(
            "for step in 0..100_000u64 {\n"
            "    steps_done.push(step);\n"
            "    tchmem::progress(step + 1, 100_000);\n"
            "    std::thread::sleep(std::time::Duration::from_millis(20));\n"
            "}"),
    ]
    notebook.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": "tchmem",
                                       "language": "rust"}
    nbformat.write(notebook, root / "live.ipynb")
    try:
        start_all(page, base, "live.ipynb")
        view = page.locator(".tchmem-live")
        view.first.wait_for(state="visible", timeout=120_000)
        first = view.first.inner_text()
        time.sleep(1.5)
        later = view.first.inner_text()
        assert first != later, f"the view did not change: {first!r}"
        assert later.startswith("running ") and "step " in later, later
        # The view is replaced at every update: scrolled to by whichever element is there now
        # (a located element may be gone before Playwright finds it stable).
        page.evaluate("() => document.querySelector('.tchmem-live')?.scrollIntoView({block: 'center'})")
        page.screenshot(path=str(SHOTS / "live-view.png"))
        # The stop button in the notebook's toolbar.
        page.locator("jp-button[data-command='notebook:interrupt-kernel'], "
                     "button[data-command='notebook:interrupt-kernel']").first.click()
        page.wait_for_function(
            "() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status"
            " === 'idle'", timeout=60_000)
        state = page.evaluate(NOTEBOOK_STATE)
        (error,) = [o["text"] for o in state["cells"][1]["outputs"] if o["type"] == "error"]
        assert error.startswith("Interrupted: stopped at the start of iteration"), error
        assert "variables kept" in error, error
        # A new cell reads what the stopped loop left.
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:insert-cell-below')")
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:enter-edit-mode')")
        page.keyboard.type("steps_done.len()")
        page.keyboard.press("Shift+Enter")
        page.wait_for_function(
            "() => { const cells = window.jupyterapp.shell.currentWidget.content.widgets;"
            " return cells[2]?.model.outputs.length > 0; }", timeout=60_000)
        kept = page.evaluate(
            "() => window.jupyterapp.shell.currentWidget.content.widgets[2].model.outputs"
            ".toJSON()[0].data['text/plain']")
        page.screenshot(path=str(SHOTS / "live-view-stopped.png"))
        assert int(kept) > 10, kept
    finally:
        shut_down_kernels(page)
