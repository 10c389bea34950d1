"""Bad things in cells: panics, crashes, interrupts, and input requests. The kernel explains each
and keeps going."""

import importlib.util
import os
import re
import subprocess
import threading
import time

from jupyter_client.manager import start_new_kernel

from conftest import (CELL_TIMEOUT, FIRST_CELL_TIMEOUT, KERNEL_NAME, execute, outputs, result_text,
                      stream_text, tchmem_bin)


def test_a_panic_is_an_error_and_keeps_older_variables(kernel):
    _, kc = kernel
    reply, _ = execute(kc, "let kept = 41;")
    assert reply["status"] == "ok"
    reply, messages = execute(kc, 'let lost = 1;\nlet v: Vec<i32> = Vec::new();\nv[3]')
    assert reply["status"] == "error"
    assert reply["ename"] == "Panic"
    assert "index out of bounds" in reply["evalue"]
    assert len(outputs(messages, "error")) == 1
    # The hook reports the panic as the error; no duplicate stderr text.
    assert "panicked at" not in stream_text(messages, "stderr")
    reply, messages = execute(kc, "kept + 1")
    assert reply["status"] == "ok" and result_text(messages) == "42"
    reply, _ = execute(kc, "lost")
    assert reply["status"] == "error" and reply["ename"] == "CompilationError"


def test_a_panic_in_a_thread_the_cell_survives_is_shown_not_fatal(kernel):
    _, kc = kernel
    code = 'std::thread::spawn(|| panic!("worker failed")).join().is_err()'
    reply, messages = execute(kc, code)
    assert reply["status"] == "ok" and result_text(messages) == "true", reply
    assert "worker failed" in stream_text(messages, "stderr")


def test_a_compile_error_in_a_chinese_cell_names_its_cell_line_and_column(kernel):
    _, kc = kernel
    # `missing` is the 25th character of line 3 (the 27th byte: the arrow takes three).
    code = 'let a = 1;\n// 你好，世界\nlet c = "→".len() + a + missing;\nc'
    started = time.monotonic()
    reply, messages = execute(kc, code)
    print(f"compile error came back in {time.monotonic() - started:.2f} s")
    assert reply["status"] == "error" and reply["ename"] == "CompilationError", reply
    assert "cannot find value `missing`" in reply["evalue"]
    (error,) = outputs(messages, "error")
    rows = [re.sub(r"\x1b\[[0-9;]*m", "", row) for row in error["traceback"]]
    text = "\n".join(rows)
    assert "cell line 3, column 25" in text, text
    assert "lib.rs" not in text, text
    # The caret sits under `missing` on the row after the cell's line 3.
    at = next(i for i, row in enumerate(rows) if row.startswith("3 | "))
    assert rows[at + 1].index("^") == rows[at].index("missing"), text


def test_a_crash_of_the_child_is_reported_and_the_next_cell_works(kernel):
    _, kc = kernel
    execute(kc, "let before_crash = 5;")
    reply, messages = execute(kc, "std::process::abort();")
    assert reply["status"] == "error"
    assert reply["ename"] == "ChildProcessCrashed"
    assert "variables were lost" in reply["evalue"]
    reply, messages = execute(kc, "2 + 2")
    assert reply["status"] == "ok" and result_text(messages) == "4"
    reply, _ = execute(kc, "before_crash")
    assert reply["status"] == "error"
    # The fresh process is set up like the first: panics still come back as clean errors.
    reply, messages = execute(kc, 'panic!("after the crash")')
    assert reply["ename"] == "Panic" and reply["evalue"] == "after the crash", reply
    assert "panicked at" not in stream_text(messages, "stderr")


def test_interrupt_stops_a_long_cell_within_seconds(kernel):
    km, kc = kernel
    msg_id = kc.execute("loop { std::thread::sleep(std::time::Duration::from_millis(10)); }")
    # Wait until the cell runs (compiled and started), then interrupt.
    while True:
        msg = kc.get_iopub_msg(timeout=CELL_TIMEOUT)
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "execute_input":
            break
    time.sleep(3)
    started = time.time()
    km.interrupt_kernel()
    reply = kc.get_shell_msg(timeout=30)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kc.get_shell_msg(timeout=30)
    elapsed = time.time() - started
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "Interrupted"
    assert elapsed < 5, f"interrupt took {elapsed:.1f} s"
    reply, messages = execute(kc, '"alive"')
    assert reply["status"] == "ok" and result_text(messages) == '"alive"'


def test_input_requests_reach_the_frontend(kernel):
    _, kc = kernel
    answered = []

    def answer():
        msg = kc.get_stdin_msg(timeout=CELL_TIMEOUT)
        answered.append(msg["content"]["prompt"])
        kc.input("Ada")

    responder = threading.Thread(target=answer)
    responder.start()
    code = 'let name = tchmem::input::get_string("name? ");\nformat!("hello {name}")'
    reply, messages = execute(kc, code, allow_stdin=True)
    responder.join(timeout=5)
    assert answered == ["name? "]
    assert reply["status"] == "ok" and result_text(messages) == '"hello Ada"'


def test_cells_queued_behind_a_failed_cell_are_aborted(kernel):
    _, kc = kernel
    ids = [kc.execute('panic!("first fails")'), kc.execute("1"), kc.execute("2")]
    replies = {}
    while len(replies) < 3:
        reply = kc.get_shell_msg(timeout=CELL_TIMEOUT)
        replies[reply["parent_header"]["msg_id"]] = reply["content"]["status"]
    assert [replies[i] for i in ids] == ["error", "aborted", "aborted"]
    reply, messages = execute(kc, "3")
    assert reply["status"] == "ok" and result_text(messages) == "3"
    # Without stop_on_error the queue runs on.
    ids = [kc.execute('panic!("fails")', stop_on_error=False), kc.execute("4")]
    replies = {}
    while len(replies) < 2:
        reply = kc.get_shell_msg(timeout=CELL_TIMEOUT)
        replies[reply["parent_header"]["msg_id"]] = reply["content"]["status"]
    assert [replies[i] for i in ids] == ["error", "ok"]


def test_output_without_a_final_newline_arrives_and_the_cell_completes(kernel):
    _, kc = kernel
    code = 'use std::io::Write;\nprint!("no newline");\nstd::io::stdout().flush().unwrap();'
    reply, messages = execute(kc, code)
    assert reply["status"] == "ok", reply
    text = stream_text(messages)
    assert "no newline" in text and "TCHMEM" not in text


def test_restart_command_gives_a_fresh_child_that_is_set_up_again(kernel):
    _, kc = kernel
    reply, _ = execute(kc, ":restart")
    assert reply["status"] == "ok", reply
    reply, messages = execute(kc, 'panic!("after a restart")')
    assert reply["ename"] == "Panic" and reply["evalue"] == "after a restart", reply
    assert "panicked at" not in stream_text(messages, "stderr")


def test_a_cell_sent_while_the_kernel_starts_shows_the_start_then_runs():
    # Its own kernel: the shared one has long started.
    km, kc = start_new_kernel(kernel_name=KERNEL_NAME, startup_timeout=120)
    try:
        # Sent at once: the engine still loads tch (seconds even in a prepared slot).
        reply, messages = execute(kc, "40 + 2", timeout=FIRST_CELL_TIMEOUT)
        assert reply["status"] == "ok" and result_text(messages) == "42"
        shown = [m for m in messages if m["msg_type"] in ("display_data", "update_display_data")
                 and ((m["content"].get("transient") or {}).get("display_id") or "")
                 .startswith("tchmem-startup")]
        assert shown, [m["msg_type"] for m in messages]
        assert "Starting the kernel" in shown[0]["content"]["data"]["text/plain"]
        # A start that built nothing leaves nothing behind: the display is cleared before the
        # cell's own output; one that compiled says what it built.
        last = shown[-1]["content"]["data"]["text/plain"]
        cleared = [i for i, m in enumerate(messages) if m["msg_type"] == "clear_output"]
        assert cleared or last.startswith("Kernel ready"), last
        result = next(i for i, m in enumerate(messages) if m["msg_type"] == "execute_result")
        assert all(i < result for i in cleared)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_a_child_whose_kernel_goes_at_once_exits_at_once():
    """A kernel shut down within seconds of its start closes its child's stdin while
    libtorch_cuda still loads there: the child must exit then and there. (Exiting through the
    process's exit handlers raced CUDA's static runtime: an abort, a 7 s exit, once a child left
    spinning on two cores.)"""
    libtorch = importlib.util.find_spec("torch").submodule_search_locations[0]
    env = dict(os.environ, TCHMEM_CHILD="1", LIBTORCH=libtorch,
               LD_LIBRARY_PATH=os.path.join(libtorch, "lib"))
    for attempt in range(3):
        started = time.monotonic()
        done = subprocess.run([tchmem_bin()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, env=env, timeout=60)
        seconds = time.monotonic() - started
        assert done.returncode == 0, (attempt, done.returncode, done.stderr[-2000:])
        # At once: before the fix the exit waited for the load (0.8-7 s here).
        assert seconds < 0.5, f"attempt {attempt}: the child took {seconds:.2f} s to exit"


def test_a_kernel_whose_runtime_crate_is_gone_says_where_and_what_to_do(tmp_path):
    """A runtime crate that is not where the kernel looks (here TCHMEM_RUNTIME_DIR names a folder
    that is gone; a binary built in a checkout since moved looks where it was built): the first
    cell says where it looked and how to mend it, once (not evcxr's error about another crate's
    Cargo.toml twice over, then "cannot find crate `tch`" in every cell); plain Rust still
    runs."""
    gone = tmp_path / "moved-away" / "runtime"
    # Compile slots of its own: the user's would get a copy of a slot's tch build for `1 + 1`.
    env = dict(os.environ, TCHMEM_RUNTIME_DIR=str(gone), TCHMEM_WORKDIR=str(tmp_path / "slots"))
    km, kc = start_new_kernel(kernel_name=KERNEL_NAME, startup_timeout=120, env=env)
    try:
        reply, messages = execute(kc, "1 + 1", timeout=FIRST_CELL_TIMEOUT)
        assert reply["status"] == "ok", reply
        assert result_text(messages) == "2"
        notice = stream_text(messages, "stderr")
        assert f"TCHMEM_RUNTIME_DIR is {gone}, which holds no tchmem runtime crate" in notice, notice
        assert "kernel.json" in notice, notice
        assert notice.count("tch is not available") == 1, notice
        reply, _ = execute(kc, "let v: Vec<i64> = (0..3).collect(); v.len()")
        assert reply["status"] == "ok", reply
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
