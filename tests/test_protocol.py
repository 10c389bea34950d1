"""Protocol robustness with jupyter_client: forged and malformed messages are dropped, the kernel
keeps answering, and the basic message flow is what Jupyter frontends expect."""

import hashlib
import hmac
import json
import os
import tempfile
import time
import uuid

import zmq
from jupyter_client.session import Session

from conftest import execute, outputs, result_text, stream_text


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
