"""Protocol robustness with jupyter_client: forged and malformed messages are dropped, the kernel
keeps answering, and the basic message flow is what Jupyter frontends expect."""

import hashlib
import hmac
import json
import os
import subprocess
import tempfile
import time
import uuid

import zmq
from jupyter_client.manager import start_new_kernel
from jupyter_client.session import Session

from conftest import (FIRST_CELL_TIMEOUT, KERNEL_NAME, charts_in, complete, execute, outputs,
                      result_text, stream_text)

# The memory summary some cells end with (%memprofile auto).
MEMORY_MIME = "application/vnd.tchmem.record+json"


def connect(km, channel):
    info = km.get_connection_info()
    if isinstance(info["key"], str):
        info["key"] = info["key"].encode()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{info['ip']}:{info[channel + '_port']}")
    return sock, info


def replies(sock, session, wait):
    """Every reply that arrives on `sock` within `wait` seconds."""
    got = []
    deadline = time.time() + wait
    while time.time() < deadline:
        if sock.poll(100):
            _, parts = session.feed_identities(sock.recv_multipart())
            got.append(session.deserialize(parts))
    return got


def test_forged_and_garbage_messages_are_dropped_and_the_kernel_still_answers(kernel):
    km, kc = kernel
    sock, info = connect(km, "shell")
    good = Session(key=info["key"], signature_scheme="hmac-sha256")
    forged = Session(key=b"not-the-key", signature_scheme="hmac-sha256")

    marker = os.path.join(tempfile.mkdtemp(), "forged-ran")
    # A forged execute_request must not run.
    forged.send(sock, "execute_request", {"code": f'std::fs::write("{marker}", "x").unwrap();',
                                          "silent": False, "store_history": True,
                                          "user_expressions": {}, "allow_stdin": False,
                                          "stop_on_error": True})
    forged.send(sock, "kernel_info_request", {})
    # Missing signature on a keyed connection.
    header = good.pack(good.msg_header("kernel_info_request"))
    sock.send_multipart([b"<IDS|MSG>", b"", header, b"{}", b"{}", b"{}"])
    # Garbage frames of several shapes.
    sock.send_multipart([b"hello"])
    sock.send_multipart([b"<IDS|MSG>"])
    sock.send_multipart([b"<IDS|MSG>", b"deadbeef", b"{not json", b"{}", b"{}", b"{}"])
    # Correctly signed, but not JSON: passes the signature check, fails parsing.
    junk = [b"\xff\xfe", b"{}", b"{}", b"[]"]
    signature = hmac.new(info["key"], b"".join(junk), hashlib.sha256).hexdigest()
    sock.send_multipart([b"<IDS|MSG>", signature.encode(), *junk])

    assert replies(sock, good, wait=3) == [], "a forged or malformed message got a reply"

    msg = good.send(sock, "kernel_info_request", {})
    got = replies(sock, good, wait=10)
    assert [r["parent_header"]["msg_id"] for r in got] == [msg["header"]["msg_id"]]
    assert got[0]["content"]["implementation"] == "tchmem"
    assert not os.path.exists(marker), "a forged execute_request was run"
    sock.close()


def test_forged_control_messages_do_not_stop_the_kernel(kernel):
    km, kc = kernel
    sock, info = connect(km, "control")
    forged = Session(key=b"not-the-key", signature_scheme="hmac-sha256")
    forged.send(sock, "shutdown_request", {"restart": False})
    sock.send_multipart([b"<IDS|MSG>", b"x", b"garbage"])
    time.sleep(2)
    assert km.is_alive()
    good = Session(key=info["key"], signature_scheme="hmac-sha256")
    msg = good.send(sock, "kernel_info_request", {})
    got = replies(sock, good, wait=10)
    assert [r["parent_header"]["msg_id"] for r in got] == [msg["header"]["msg_id"]]
    sock.close()


def test_kernel_info_describes_rust(kernel):
    _, kc = kernel
    reply = kc.kernel_info(reply=True, timeout=10)["content"]
    info = reply["language_info"]
    assert reply["protocol_version"] == "5.3"
    assert info["name"] == "rust"
    assert info["mimetype"] == "text/rust"
    assert info["file_extension"] == ".rs"
    assert info["pygments_lexer"] == "rust"
    assert info["codemirror_mode"] == "rust"
    assert info["version"][0].isdigit()


def test_execution_count_counts_only_stored_cells(kernel):
    _, kc = kernel
    first, _ = execute(kc, "1")
    unstored, messages = execute(kc, "2", store_history=False)
    second, _ = execute(kc, "3")
    assert unstored["execution_count"] == first["execution_count"]
    assert second["execution_count"] == first["execution_count"] + 1
    silent, messages = execute(kc, 'println!("quiet"); 4', silent=True)
    assert silent["status"] == "ok"
    assert outputs(messages, "stream") == [] and outputs(messages, "execute_result") == []


def test_stream_output_is_batched_in_order_and_arrives_before_idle(kernel):
    _, kc = kernel
    code = """
for i in 0..200 { println!("out {i}"); }
for i in 0..50 { eprintln!("err {i}"); }
println!("last");
"""
    reply, messages = execute(kc, code)
    assert reply["status"] == "ok"
    assert stream_text(messages, "stdout") == "".join(f"out {i}\n" for i in range(200)) + "last\n"
    assert stream_text(messages, "stderr") == "".join(f"err {i}\n" for i in range(50))
    # Batched: far fewer messages than lines, and everything before idle (execute() stops there).
    assert len(outputs(messages, "stream")) < 20
    types = [m["msg_type"] for m in messages]
    assert types[0] == "status" and types[-1] == "status"


def test_rust_values_and_evcxr_commands(kernel):
    _, kc = kernel
    reply, messages = execute(kc, 'let greeting = String::from("hi");\ngreeting.len()')
    assert reply["status"] == "ok" and result_text(messages) == "2"
    reply, messages = execute(kc, ":vars")
    assert reply["status"] == "ok"
    assert "greeting" in json.dumps([m["content"] for m in messages])


def test_compile_errors_are_readable(kernel):
    _, kc = kernel
    reply, messages = execute(kc, 'let n: i32 = "text";')
    assert reply["status"] == "error"
    assert reply["ename"] == "CompilationError"
    assert "mismatched types" in reply["evalue"]
    (error,) = outputs(messages, "error")
    assert any("expected `i32`" in line for line in error["traceback"])


def test_unknown_session_ids_get_fresh_uuid_msg_ids(kernel):
    _, kc = kernel
    reply = kc.kernel_info(reply=True, timeout=10)
    uuid.UUID(reply["header"]["msg_id"])


def test_completion_offers_names_with_their_signatures_beside_them(kernel):
    _, kc = kernel
    reply, _ = execute(kc, "let completion_tensor = tch::Tensor::from(1.0f32);")
    assert reply["status"] == "ok", reply
    content = complete(kc, "completion_tensor.siz")
    # Names to insert, not calls with their parameter names filled in.
    assert "size" in content["matches"], content["matches"]
    assert all("(" not in m for m in content["matches"]), content["matches"]
    assert content["cursor_start"] == len("completion_tensor.")
    types = content["metadata"]["_jupyter_types_experimental"]
    size = next(t for t in types if t["text"] == "size")
    assert size["signature"].startswith("size(") and size["type"] == "function", size


def test_the_analysis_knows_the_standard_library(kernel):
    """The code analysis reads the library's crates without their workspace (see
    src/session/analysis_std.rs): std's types and methods are still known to it."""
    _, kc = kernel
    reply, _ = execute(
        kc,
        "let analysed_map = std::collections::HashMap::<String, u8>::new();\n"
        "let analysed_vec = vec![1u16];",
    )
    assert reply["status"] == "ok", reply
    reply, messages = execute(kc, ":vars")
    listed = json.dumps([m["content"] for m in messages])
    assert "HashMap<String, u8>" in listed and "Vec<u16>" in listed, listed
    content = complete(kc, "analysed_map.contains_k")
    assert "contains_key" in content["matches"], content["matches"]
    content = complete(kc, "analysed_vec.extend_from_sl")
    assert "extend_from_slice" in content["matches"], content["matches"]


def test_the_first_completion_of_a_new_kernel_has_names_and_signatures():
    """Right after the first cell the engine loads the code analysis (seconds); meanwhile a path
    seen before (`tchmem prepare` and every warm-up remember `tch::Tensor::`) is answered from
    what was kept. Either way the answer is complete (scripts/bench/completion times it)."""
    km, kc = start_new_kernel(kernel_name=KERNEL_NAME, startup_timeout=120)
    try:
        reply, _ = execute(kc, "1 + 1", timeout=FIRST_CELL_TIMEOUT)
        assert reply["status"] == "ok", reply
        content = complete(kc, "let z = tch::Tensor::zer")
        assert "zeros" in content["matches"] and "zeros_like" in content["matches"], content
        assert content["cursor_start"] == len("let z = tch::Tensor::")
        types = content["metadata"]["_jupyter_types_experimental"]
        zeros = next(t for t in types if t["text"] == "zeros")
        assert zeros["signature"].startswith("zeros(") and zeros["type"] == "function", zeros
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_a_first_cells_dep_line_reaches_cargo_online(tmp_path):
    """The prelude runs with cargo offline (src/session/offline.rs), and evcxr writes that into
    the compile slot's cargo configuration, which its check of a `:dep` line reads. A first cell's
    `:dep` of a git crate (a local repository: cargo refuses any git checkout offline) is checked
    and built online."""
    repo = tmp_path / "tiny"
    (repo / "src").mkdir(parents=True)
    (repo / "Cargo.toml").write_text('[package]\nname = "tiny"\nversion = "0.1.0"\nedition = "2021"\n')
    (repo / "src" / "lib.rs").write_text("pub fn answer() -> i32 { 42 }\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.org"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "tiny"]):
        subprocess.run(git + args, check=True)
    km, kc = start_new_kernel(kernel_name=KERNEL_NAME, startup_timeout=120)
    try:
        reply, messages = execute(
            kc, f':dep tiny = {{ git = "file://{repo}" }}\ntiny::answer()', timeout=FIRST_CELL_TIMEOUT
        )
        assert reply["status"] == "ok", reply
        assert result_text(messages) == "42"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_evcxr_rich_output_is_display_data_in_order_with_the_text(kernel):
    _, kc = kernel
    code = r"""
use std::io::Write;
println!("before");
println!("EVCXR_BEGIN_CONTENT text/html\n<b>first</b>\nline two\nEVCXR_END_CONTENT");
// A block arriving in pieces, the marker itself split.
print!("EVCXR_BEGIN_CON");
std::io::stdout().flush().unwrap();
std::thread::sleep(std::time::Duration::from_millis(100));
print!("TENT image/svg+xml\n<svg xmlns='http://www.w3.org/2000/svg'>");
std::io::stdout().flush().unwrap();
std::thread::sleep(std::time::Duration::from_millis(100));
println!("</svg>\nEVCXR_END_CONTENT");
println!("after");
"""
    reply, messages = execute(kc, code)
    assert reply["status"] == "ok", reply
    messages = [m for m in messages if MEMORY_MIME not in m["content"].get("data", {})]
    kinds = [
        (m["msg_type"], m["content"].get("text") or sorted(m["content"].get("data", {})))
        for m in messages
        if m["msg_type"] in ("stream", "display_data", "execute_result")
    ]
    assert kinds == [
        ("stream", "before\n"),
        ("display_data", ["text/html", "text/plain"]),
        ("display_data", ["image/svg+xml", "text/html", "text/plain"]),
        ("stream", "after\n"),
    ], kinds
    html, svg = outputs(messages, "display_data")
    assert html["data"]["text/html"] == "<b>first</b>\nline two"
    assert html["data"]["text/plain"] == "[HTML output]"
    assert svg["data"]["image/svg+xml"] == "<svg xmlns='http://www.w3.org/2000/svg'></svg>"
    # An image of it too, which JupyterLab shows in a notebook it does not trust.
    assert charts_in(svg["data"]["text/html"]) == [svg["data"]["image/svg+xml"]]
    assert "EVCXR" not in stream_text(messages)


def test_evcxr_display_of_a_cell_value_is_still_its_result(kernel):
    _, kc = kernel
    code = r"""
struct Shown;
impl Shown {
    fn evcxr_display(&self) {
        println!("EVCXR_BEGIN_CONTENT text/html\n<p>shown</p>\nEVCXR_END_CONTENT");
    }
}
Shown
"""
    reply, messages = execute(kc, code)
    assert reply["status"] == "ok", reply
    messages = [m for m in messages if MEMORY_MIME not in m["content"].get("data", {})]
    assert outputs(messages, "display_data") == []
    (result,) = outputs(messages, "execute_result")
    assert result["data"]["text/html"] == "<p>shown</p>"
    # A loop ending a cell has no value: what it prints the evcxr way is displays.
    code = r"""
for i in 0..2 {
    println!("EVCXR_BEGIN_CONTENT text/html\n<p>{i}</p>\nEVCXR_END_CONTENT");
}
"""
    reply, messages = execute(kc, code)
    assert reply["status"] == "ok", reply
    messages = [m for m in messages if MEMORY_MIME not in m["content"].get("data", {})]
    assert [d["data"]["text/html"] for d in outputs(messages, "display_data")] == [
        "<p>0</p>",
        "<p>1</p>",
    ]
    assert outputs(messages, "execute_result") == []


def test_help_goes_to_the_pager(kernel):
    _, kc = kernel
    for code, expected in [
        (":help", ":dep"),
        ("%memprofile --help", "auto"),
        ("%%optimize --help", "--checkpoint"),
    ]:
        reply, messages = execute(kc, code)
        assert reply["status"] == "ok", (code, reply)
        (page,) = reply["payload"]
        assert page["source"] == "page" and page["start"] == 0
        assert expected in page["data"]["text/plain"], (code, page)
        # Shown once, by the pager: not also as output.
        assert outputs(messages, "execute_result") == [], code
        assert expected not in stream_text(messages), code
    # Other commands keep their output.
    reply, messages = execute(kc, ":vars")
    assert reply["payload"] == []


def test_opt_sets_the_level_of_cells_only_and_rejects_unknown_levels(kernel):
    _, kc = kernel
    reply, messages = execute(kc, ":opt 2\n21 * 2")
    assert reply["status"] == "ok", reply
    assert "Optimization: 2 (cells' own code" in stream_text(messages)
    assert result_text(messages) == "42"
    reply, _ = execute(kc, ":opt fast")
    assert reply["status"] == "error" and "0, 1, 2, 3, s, z" in reply["evalue"], reply
    reply, messages = execute(kc, ":opt 0\nformat!(\"{}\", 6 * 7)")
    assert reply["status"] == "ok" and result_text(messages) == '"42"', reply
