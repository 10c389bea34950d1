"""Long training cells: the live view under a running cell, and an interrupt that stops the cell
at a loop boundary and keeps the notebook's variables (the model, its VarStore, the optimizer)."""

import re
import time
from datetime import datetime

from conftest import CELL_TIMEOUT, execute, result_text, stream_text, wait_for

LIVE_PREFIX = "tchmem-live-"

# A small regression on CPU: the model and optimizer live in an earlier cell, as users write them.
SETUP = """use tch::{nn, nn::Module, nn::OptimizerConfig, Device, Kind, Tensor};
tch::manual_seed(0);
let vs = nn::VarStore::new(Device::Cpu);
let net = nn::linear(vs.root(), 64, 1, Default::default());
let mut opt = nn::Sgd::default().build(&vs, 1e-3).unwrap();
let xs = Tensor::randn([256, 64], (Kind::Float, Device::Cpu));
let ys = xs.sum_dim_intlist(-1, true, Kind::Float);
let mut losses: Vec<f64> = Vec::new();"""

# Slow on purpose (a sleep per step): the interrupt lands in the middle.
TRAIN = """for step in 1..=100_000 {
    let loss = net.forward(&xs).mse_loss(&ys, tch::Reduction::Mean);
    opt.backward_step(&loss);
    losses.push(loss.double_value(&[]));
    std::thread::sleep(std::time::Duration::from_millis(5));
}"""


# A loop the kernel does not see (an iterator chain): no boundary to stop at.
NO_BOUNDARY = """(0..u64::MAX)
    .map(|i| { std::thread::sleep(std::time::Duration::from_millis(5)); i })
    .sum::<u64>()"""


def start(kc, code):
    """Sends `code` with a first line that prints, and returns its msg_id once that line came
    (the cell compiled and its code runs: an interrupt during the compile would stop it at its
    first loop instead)."""
    msg_id = kc.execute('println!("started");\n' + code)
    while True:
        msg = kc.get_iopub_msg(timeout=CELL_TIMEOUT)
        if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream"
                and "started" in msg["content"]["text"]):
            return msg_id


def live_messages(messages):
    """The live view's display_data and update_display_data messages, in order."""
    return [m for m in messages
            if m["msg_type"] in ("display_data", "update_display_data")
            and (m["content"].get("transient") or {}).get("display_id", "").startswith(LIVE_PREFIX)]


def sent_at(msg):
    """When the kernel sent `msg`, in seconds."""
    date = msg["header"]["date"]
    if isinstance(date, str):
        date = datetime.fromisoformat(date.replace("Z", "+00:00"))
    return date.timestamp()


def value(kc, code):
    reply, messages = execute(kc, code)
    assert reply["status"] == "ok", reply
    return result_text(messages)


def test_an_interrupted_loop_stops_at_a_boundary_and_training_goes_on(kernel):
    km, kc = kernel
    reply, _ = execute(kc, SETUP)
    assert reply["status"] == "ok", reply
    msg_id = start(kc, TRAIN)
    time.sleep(2.5)
    asked = time.monotonic()
    km.interrupt_kernel()
    reply, replied, messages = wait_for(kc, msg_id)
    took = replied - asked
    print(f"interrupt answered in {took:.2f} s")
    assert reply["status"] == "error" and reply["ename"] == "Interrupted", reply
    match = re.match(r"stopped at the start of iteration ([\d,]+) of the loop at line 2; "
                     r"variables kept", reply["evalue"])
    assert match, reply["evalue"]
    assert took < 1.0, f"the cell stopped {took:.2f} s after the interrupt"
    stopped_at = int(match.group(1).replace(",", ""))
    # Every finished step was kept: the one it stopped at had not started.
    assert int(value(kc, "losses.len()")) == stopped_at - 1
    first, last = (float(value(kc, f"losses[{i}]")) for i in (0, stopped_at - 2))
    assert last < first / 2, (first, last)
    # The same loop again goes on from the trained weights, with the same optimizer.
    reply, _ = execute(kc, "let before = losses.len();\n" + TRAIN.replace("100_000", "20"))
    assert reply["status"] == "ok", reply
    resumed = float(value(kc, "losses[before]"))
    assert resumed <= last * 1.05, (resumed, last)
    # The live view showed the interrupted run, one display updated in place.
    live = live_messages(messages)
    assert live and live[0]["msg_type"] == "display_data", [m["msg_type"] for m in messages]
    ids = {m["content"]["transient"]["display_id"] for m in live}
    assert len(ids) == 1, ids
    assert all(m["msg_type"] == "update_display_data" for m in live[1:])
    text = live[-1]["content"]["data"]["text/plain"]
    assert text.startswith("ran ") and re.search(r"iteration [\d,]+ of the loop at line 2 ", text), text
    assert "memory curves need CUDA" in text or "allocated" in text, text


def test_the_live_view_updates_under_a_running_cell_and_not_under_a_short_one(kernel):
    _, kc = kernel
    code = """for step in 0..12 {
    tchmem::progress(step + 1, 12);
    tchmem::progress::loss(1.0 / (step + 1) as f64);
    std::thread::sleep(std::time::Duration::from_millis(200));
}"""
    reply, messages = execute(kc, code)
    assert reply["status"] == "ok", reply
    live = live_messages(messages)
    assert len(live) >= 4, [m["msg_type"] for m in messages]
    # At most four updates a second (the last one, the run's end, comes when it ends).
    sent = [sent_at(m) for m in live[:-1]]
    gaps = [b - a for a, b in zip(sent, sent[1:])]
    assert gaps and all(gap >= 0.2 for gap in gaps), gaps
    texts = [m["content"]["data"]["text/plain"] for m in live]
    assert any(re.search(r"step \d+/12 \[#*\.*\]", t) for t in texts[:-1]), texts
    assert any("loss 0." in t for t in texts), texts
    assert texts[-1].startswith("ran 2."), texts[-1]
    assert "<div" in live[0]["content"]["data"]["text/html"]
    reply, messages = execute(kc, "1 + 1")
    assert reply["status"] == "ok" and not live_messages(messages)


def test_code_that_asks_for_the_interrupt_ends_by_itself(kernel):
    km, kc = kernel
    code = """let seen = (0..).take_while(|_| !tchmem::interrupted())
    .map(|i: u64| { std::thread::sleep(std::time::Duration::from_millis(5)); i })
    .count();
seen > 0"""
    msg_id = start(kc, code)
    time.sleep(1.5)
    km.interrupt_kernel()
    reply, _, messages = wait_for(kc, msg_id)
    assert reply["status"] == "ok", reply
    assert result_text(messages) == "true"
    assert "saw the interrupt" in stream_text(messages, "stderr")


def test_a_cell_with_no_boundary_is_stopped_after_the_grace_period(kernel):
    km, kc = kernel
    execute(kc, "let kept_until_now = 3;")
    msg_id = start(kc, NO_BOUNDARY)
    time.sleep(1.5)
    asked = time.monotonic()
    km.interrupt_kernel()
    reply, replied, _ = wait_for(kc, msg_id)
    assert reply["ename"] == "Interrupted", reply
    assert "no loop boundary within 5 s" in reply["evalue"], reply["evalue"]
    assert "all variables were lost" in reply["evalue"]
    assert 4.5 < replied - asked < 15, replied - asked
    reply, _ = execute(kc, "kept_until_now")
    assert reply["status"] == "error"
    assert value(kc, '"alive"') == '"alive"'


def test_a_second_interrupt_stops_at_once(kernel):
    km, kc = kernel
    msg_id = start(kc, NO_BOUNDARY)
    time.sleep(1.5)
    km.interrupt_kernel()
    time.sleep(0.5)
    asked = time.monotonic()
    km.interrupt_kernel()
    reply, replied, _ = wait_for(kc, msg_id)
    assert reply["ename"] == "Interrupted", reply
    assert "second interrupt" in reply["evalue"], reply["evalue"]
    assert replied - asked < 3, replied - asked
    assert value(kc, "2 + 2") == "4"


def test_compare_runs_show_which_side_and_step_they_are_in(kernel):
    _, kc = kernel
    setup = """use tch::{nn, nn::Module, nn::OptimizerConfig, Device, Kind, Tensor};
let slow_batches: Vec<(Tensor, Tensor)> = (0..8)
    .map(|_| (Tensor::randn([32, 16], (Kind::Float, Device::Cpu)),
              Tensor::randn([32, 4], (Kind::Float, Device::Cpu))))
    .collect();"""
    reply, _ = execute(kc, setup)
    assert reply["status"] == "ok", reply
    loop = """let vs = nn::VarStore::new(Device::Cpu);
let model = nn::linear(vs.root(), 16, 4, Default::default());
let mut opt = nn::Sgd::default().build(&vs, 1e-2).unwrap();
for (xs, ys) in slow_batches.iter() {
    std::thread::sleep(std::time::Duration::from_millis(300));
    let loss = model.forward(xs).mse_loss(ys, tch::Reduction::Mean);
    opt.backward_step(&loss);
}"""
    reply, messages = execute(kc, "%%optimize --accumulate 2 --compare 6\n" + loop)
    assert reply["status"] == "ok", reply
    live = live_messages(messages)
    texts = [m["content"]["data"]["text/plain"] for m in live]
    ids = {m["content"]["transient"]["display_id"] for m in live}
    assert len(ids) == 2, (ids, texts)
    for side in ("original", "rewritten"):
        assert any(re.search(f"--compare: {side} · step \\d/6 ", t) for t in texts), texts
