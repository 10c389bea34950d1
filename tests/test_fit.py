"""The "will it fit?" magics through the real kernel, on CPU: %memestimate's fixed terms equal the
tensor bytes of a known model (its trials run the real cell, at batch sizes the kernel chose),
%memestimate alone acts on the last training cell, %memfit and %%optimize --fit say what a CPU
cannot do and lose nothing, %memfree, and every mistake explained with the kernel still usable.
The GPU side (predictions against measured peaks, the batch search under a memory fraction, an
OOM's diagnosis) is tests/test_gpu.py's."""

import json
import os

from conftest import ESTIMATE_MIME, displayed, execute, outputs, page_text, skip_on_cuda, stream_text

TRIALS_MIME = "application/vnd.tchmem.trials+json"

# 64·256 + 256 + 256·10 + 10 = 19_210 parameters, f32.
PARAMETERS = (64 * 256 + 256 + 256 * 10 + 10) * 4

LOOP = """
use tch::{nn, nn::Module, nn::OptimizerConfig, Device, Kind, Tensor};
let batch_size: i64 = 32;
let vs = nn::VarStore::new(Device::Cpu);
let model = nn::seq()
    .add(nn::linear(vs.root() / "a", 64, 256, Default::default()))
    .add_fn(|x| x.relu())
    .add(nn::linear(vs.root() / "b", 256, 10, Default::default()));
let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
let xs = Tensor::randn([batch_size, 64], (Kind::Float, Device::Cpu));
let ys = Tensor::randint(10, [batch_size], (Kind::Int64, Device::Cpu));
for _ in 0..3 {
    let loss = model.forward(&xs).cross_entropy_for_logits(&ys);
    opt.backward_step(&loss);
}
println!("trained at {batch_size}");
"""


def test_estimate_fixed_terms_are_the_models_tensor_bytes(kernel):
    _, kc = kernel
    skip_on_cuda(kc)
    reply, messages = execute(kc, "%memestimate --batch 256\n" + LOOP, timeout=600)
    assert reply["status"] == "ok", reply
    # The calibration trials ran the cell at batch sizes the kernel picked (a quarter and a half
    # of 256), shown live in one display updated in place.
    trials = displayed(messages, TRIALS_MIME)
    assert trials, messages
    batches = [t["batch"] for t in trials[-1]["trials"]]
    assert batches == [64, 128], trials[-1]
    assert outputs(messages, "update_display_data"), "the trial table is updated in place"
    # The trials' own output is not shown.
    assert "trained at" not in stream_text(messages)
    (estimate,) = displayed(messages, ESTIMATE_MIME)
    assert estimate["parameters"] == PARAMETERS
    assert estimate["gradients"] == PARAMETERS
    # Adam: two f32 moments per element (and tchmem's rule counts a 4-byte step per tensor).
    assert estimate["optimizer_state"] == 2 * PARAMETERS + 4 * 4, estimate
    assert "batch_size = 256" in estimate["what"] and "Adam" in estimate["what"]
    # The cell's own variables were not touched: the trials ran in blocks.
    reply, _ = execute(kc, "batch_size")
    assert reply["status"] == "error", "a trial leaked the cell's variables"


def test_estimate_runs_its_trials_with_the_techniques_beyond_pytorch(kernel):
    _, kc = kernel
    skip_on_cuda(kc)
    reply, messages = execute(
        kc, "%memestimate --batch 64 --checkpoint --offload --step-in-backward\n" + LOOP, timeout=600)
    assert reply["status"] == "ok", reply
    (estimate,) = displayed(messages, ESTIMATE_MIME)
    # The trials stepped in backward: the gradients are no fixed term.
    assert estimate["parameters"] == PARAMETERS
    assert estimate["gradients"] == 0, estimate
    assert any("freed in backward" in text for text in displayed(messages, "text/plain")), messages
    # %%optimize's rules: offload needs --checkpoint.
    reply, _ = execute(kc, "%memestimate --offload\n" + LOOP)
    assert reply["status"] == "error" and "Add --checkpoint" in reply["evalue"], reply


def test_estimate_alone_acts_on_the_last_training_cell_and_predicts_other_optimizers(kernel):
    _, kc = kernel
    skip_on_cuda(kc)
    reply, messages = execute(kc, LOOP, timeout=300)
    assert reply["status"] == "ok", reply
    assert "trained at 32" in stream_text(messages)
    reply, messages = execute(kc, "%memestimate --optimizer adafactor", timeout=600)
    assert reply["status"] == "ok", reply
    (estimate,) = displayed(messages, ESTIMATE_MIME)
    assert "batch_size = 32" in estimate["what"] and "Adafactor" in estimate["what"]
    # Adafactor's factored rule: rows + columns of each matrix, the biases whole.
    assert estimate["optimizer_state"] == (64 + 256 + 256 + 256 + 10 + 10) * 4, estimate


def test_estimate_per_rank_of_data_parallel_ranks_counts_the_zero_share(kernel):
    """--gpus 2 --zero 1: the trials run at one rank's half of the batch; each rank keeps the
    parameters and gradients whole and the optimizer state of its share, shared out as
    tchmem::dist::ZeroOptimizer does (the largest tensor first to the least loaded rank): rank 0
    gets a.weight (64·256 f32), rank 1 the rest, and the most loaded rank's state is shown."""
    _, kc = kernel
    skip_on_cuda(kc)
    reply, messages = execute(kc, "%memestimate --batch 256 --gpus 2 --zero 1\n" + LOOP,
                              timeout=600)
    assert reply["status"] == "ok", reply
    trials = displayed(messages, TRIALS_MIME)
    assert [t["batch"] for t in trials[-1]["trials"]] == [32, 64], trials[-1]
    (estimate,) = displayed(messages, ESTIMATE_MIME)
    assert estimate["parameters"] == PARAMETERS and estimate["gradients"] == PARAMETERS
    a_weight = 64 * 256 * 4
    assert estimate["optimizer_state"] == 2 * a_weight + 4, estimate
    assert "per rank of 2 (128 each)" in estimate["what"], estimate["what"]
    assert "ZeRO stage 1" in estimate["what"], estimate["what"]
    # Mistakes are explained and lose nothing.
    for flags, says in [("--batch 256 --gpus 3", "does not split evenly"),
                        ("--gpus 2 --zero 3", "--zero 1 or --zero 2"),
                        ("--gpus 2 --zero 1 --check", "%%distributed"),
                        ("--zero 1", "--gpus")]:
        reply, _ = execute(kc, f"%memestimate {flags}\n" + LOOP)
        assert reply["status"] == "error" and says in reply["evalue"], (flags, reply)


def test_memfit_and_fit_on_cpu_say_what_they_cannot_do_and_lose_nothing(kernel):
    _, kc = kernel
    skip_on_cuda(kc)
    reply, messages = execute(kc, "%memfit\n" + LOOP, timeout=300)
    assert reply["status"] == "ok", reply
    assert "no CUDA device" in stream_text(messages)
    # --fit on CPU runs the loop as written, keeping its variables.
    reply, messages = execute(kc, "%%optimize --fit 8GiB\n" + LOOP, timeout=300)
    assert reply["status"] == "ok", reply
    text = stream_text(messages)
    assert "no CUDA device" in text and "trained at 32" in text
    reply, messages = execute(kc, "batch_size * 2")
    assert reply["status"] == "ok", reply
    reply, messages = execute(kc, "%memfree")
    assert reply["status"] == "ok", reply
    assert "nothing to free" in stream_text(messages)


def test_fit_magics_explain_mistakes_and_the_kernel_continues(kernel):
    _, kc = kernel
    reply, _ = execute(kc, "%memfit --help")
    assert reply["status"] == "ok"
    assert "--keep-effective-batch" in page_text(reply)
    reply, _ = execute(kc, "%memestimate --help")
    assert "--accumulate" in page_text(reply)
    reply, _ = execute(kc, "%memfit --margin lots\n" + LOOP)
    assert reply["status"] == "error" and "10%" in reply["evalue"], reply
    # No batch binding: it says what to write.
    no_batch = LOOP.replace("let batch_size: i64 = 32;", "let batch_size: i64 = 16 * 2;")
    reply, _ = execute(kc, "%memestimate\n" + no_batch)
    assert reply["status"] == "error", reply
    assert reply["ename"] == "RewriteRefused"
    assert "integer literal" in reply["evalue"] and "line 4" in reply["evalue"], reply["evalue"]
    # A model the kernel cannot follow to a VarStore (made here, or by an earlier cell) would be
    # trained by each trial in turn: refused.
    reply, _ = execute(kc, "%memestimate\nlet batch = 4;\nfor _ in 0..2 { unknown.backward_step(&loss); }")
    assert reply["status"] == "error" and "VarStore" in reply["evalue"], reply
    reply, _ = execute(kc, "%%optimize --fit 8GiB --amp bf16\n" + LOOP)
    assert reply["status"] == "error" and "--amp" in reply["evalue"], reply
    reply, messages = execute(kc, "1 + 1")
    assert reply["status"] == "ok"


def test_the_cells_process_detaches_the_gpu_profiler_after_each_profile(kernel):
    # The calibration trials profile a step's GPU work with libtorch's kineto, which leaves CUPTI
    # attached after the profile (every later kernel launch slower: 13-26% on the H200) unless
    # TEARDOWN_CUPTI=1 is in the environment of the process that runs the cells; a user's own
    # setting (in the kernel's environment, as the test's) stands.
    _, kc = kernel
    reply, messages = execute(kc, 'std::env::var("TEARDOWN_CUPTI").unwrap_or_default()')
    assert reply["status"] == "ok", reply
    (result,) = outputs(messages, "execute_result")
    expected = os.environ.get("TEARDOWN_CUPTI", "1")
    assert result["data"]["text/plain"] == f'"{expected}"', result
