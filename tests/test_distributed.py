"""`%%distributed`: a cell run by several processes of one Gloo group, from a real kernel. Each
rank keeps its own variables between such cells, apart from the notebook's; its output is
labelled; a panic on one rank while another waits for it in a collective, or a rank that dies,
is reported with its rank in seconds, and the next cell gets a new world."""

import re
import time

from conftest import FIRST_CELL_TIMEOUT, charts_in, execute, outputs, stream_text

RANKS_MIME = "application/vnd.tchmem.ranks+json"

# Data parallel as a user writes it: each rank trains on its half of the batch and all-reduces
# the gradients; each also trains, on its own, the same model on the whole batch (f64) for the
# reference. The step must be the same to 1e-10.
DATA_PARALLEL = """%%distributed --procs 2
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
fn model(seed: i64) -> (nn::VarStore, nn::Sequential, nn::Optimizer) {
    tch::manual_seed(seed);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "a", 6, 16, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(vs.root() / "b", 16, 1, Default::default()));
    vs.double();
    let opt = nn::Sgd { momentum: 0.9, ..Default::default() }.build(&vs, 0.05).unwrap();
    (vs, net, opt)
}
tch::manual_seed(7);
let xs = Tensor::randn([8, 6], (Kind::Double, Device::Cpu));
let ys = Tensor::randn([8, 1], (Kind::Double, Device::Cpu));
let (vs, net, mut opt) = model(1 + tchmem::dist::rank() as i64);
tchmem::dist::broadcast_parameters(&vs).unwrap();
let (whole_vs, whole_net, mut whole_opt) = model(1);
let half = xs.narrow(0, 4 * tchmem::dist::rank() as i64, 4);
let half_ys = ys.narrow(0, 4 * tchmem::dist::rank() as i64, 4);
for _ in 0..3 {
    opt.zero_grad();
    half.apply(&net).mse_loss(&half_ys, tch::Reduction::Mean).backward();
    tchmem::dist::all_reduce_gradients(&vs).unwrap();
    opt.step();
    whole_opt.zero_grad();
    xs.apply(&whole_net).mse_loss(&ys, tch::Reduction::Mean).backward();
    whole_opt.step();
}
let (ours, whole) = (vs.variables(), whole_vs.variables());
let diff = ours.iter().map(|(name, p)| (p - &whole[name]).abs().max().double_value(&[])).fold(0.0, f64::max);
println!("max difference {diff:e}");
"""


def test_ranks_keep_their_own_variables_and_label_their_output(kernel):
    _, kc = kernel
    reply, _ = execute(kc, "let home = 7;")
    assert reply["status"] == "ok", reply

    reply, messages = execute(
        kc,
        "%%distributed --procs 2\n"
        "let r = tchmem::dist::rank();\n"
        'println!("rank {} of {}", r, tchmem::dist::world_size());',
        # The world's first cell builds its crate; after a change of tchmem, its dependencies too.
        timeout=FIRST_CELL_TIMEOUT,
    )
    assert reply["status"] == "ok", reply
    out = stream_text(messages)
    assert "[rank 0] rank 0 of 2" in out and "[rank 1] rank 1 of 2" in out, out
    assert "2 ranks started" in stream_text(messages, "stderr")

    reply, messages = execute(kc, '%%distributed --procs 2\nprintln!("{}", r * 10);')
    assert reply["status"] == "ok", reply
    out = stream_text(messages)
    assert "[rank 0] 0" in out and "[rank 1] 10" in out, out

    # The notebook's own variables are its own.
    reply, messages = execute(kc, 'println!("{home}");')
    assert reply["status"] == "ok", reply
    assert stream_text(messages) == "7\n"


def test_two_gloo_ranks_on_half_batches_step_like_one_process_on_the_whole_batch(kernel):
    _, kc = kernel
    reply, messages = execute(kc, DATA_PARALLEL)
    assert reply["status"] == "ok", reply
    out = stream_text(messages)
    found = re.findall(r"\[rank (\d)\] max difference (\S+)", out)
    assert sorted(rank for rank, _ in found) == ["0", "1"], out
    assert all(float(diff) <= 1e-10 for _, diff in found), out

    # Memory per rank: each rank's record (the stores each made, watched where made), one
    # column and one row per rank, and the spread between them.
    [display] = [d for d in outputs(messages, "display_data") if RANKS_MIME in d["data"]]
    records = display["data"][RANKS_MIME]
    assert len(records) == 2 and all(records), records
    for record in records:
        parameters = [c for c in record["categories"] if c["name"] == "parameters"]
        assert parameters and parameters[0]["bytes"] > 0, record
    text = display["data"]["text/plain"]
    assert re.search(r"^0 +cpu", text, re.M) and re.search(r"^1 +cpu", text, re.M), text
    assert "spread between ranks" in text, text  # equal here: "no spread between ranks: …"
    assert len(charts_in(display["data"]["text/html"])) == 1


def test_a_rank_that_panics_is_named_and_the_ranks_waiting_for_it_are_stopped(kernel):
    _, kc = kernel
    started = time.monotonic()
    reply, messages = execute(
        kc,
        "%%distributed --procs 2\n"
        'if tchmem::dist::rank() == 1 { panic!("rank one gives up"); }\n'
        "tchmem::dist::barrier().unwrap();",
    )
    took = time.monotonic() - started
    assert reply["status"] == "error", reply
    said = "\n".join(reply["traceback"]) + reply["evalue"] + stream_text(messages, "stderr")
    assert "[rank 1] rank one gives up" in said, said
    assert "rank 1 panicked" in said and "stopped" in said, said
    assert took < 60, took

    # A new world for the next cell; the old one's variables are gone, the notebook's kept.
    reply, messages = execute(
        kc, '%%distributed --procs 2\nprintln!("again {}", tchmem::dist::rank());'
    )
    assert reply["status"] == "ok", reply
    assert "[rank 1] again 1" in stream_text(messages)
    reply, _ = execute(kc, "%%distributed --procs 2\nr")
    assert reply["status"] == "error"

    # A rank that dies (an abort) stops the others at once, and is named.
    reply, messages = execute(
        kc,
        "%%distributed --procs 2\n"
        "if tchmem::dist::rank() == 1 { std::process::abort(); }\n"
        "tchmem::dist::barrier().unwrap();",
    )
    assert reply["status"] == "error", reply
    said = "\n".join(reply["traceback"]) + reply["evalue"] + stream_text(messages, "stderr")
    assert "rank 1 ended during the cell" in said, said
    reply, messages = execute(kc, "%%distributed --procs 2\ntchmem::dist::world_size()")
    assert reply["status"] == "ok", reply
    reply, messages = execute(kc, "home + 1")
    assert reply["status"] == "ok", reply


def test_bad_flags_are_explained(kernel):
    _, kc = kernel
    reply, _ = execute(kc, "%%distributed\n1")
    assert reply["status"] == "error" and "--procs 2" in reply["evalue"], reply
    reply, _ = execute(kc, "%%distributed --gpus 2\n1")
    assert reply["status"] == "error" and "NCCL" in reply["evalue"], reply
