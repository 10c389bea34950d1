"""tch code as tch users write it (the style of tch-rs's examples and docs), pasted into cells of a
real kernel: it compiles and runs as it would in a `main.rs` of edition 2021."""

import platform

import pytest
from conftest import ESTIMATE_MIME, displayed, execute, outputs, result_text, stream_text

# A model part the way tch-rs's examples build them: a function taking `&nn::Path` and returning
# `impl ModuleT` (edition 2021 code: the return type does not capture the path's lifetime).
BLOCK = """use tch::nn::{self, ModuleT};
use tch::{Device, Kind, Tensor};

fn residual_block(p: &nn::Path, dim: i64) -> impl ModuleT {
    let norm = nn::layer_norm(p / "norm", vec![dim], Default::default());
    let proj = nn::linear(p / "proj", dim, dim, Default::default());
    nn::func_t(move |xs, train| xs + xs.apply(&norm).apply(&proj).dropout(0.1, train))
}
"""

# The block built from a temporary path and used in one expression: a borrow of the temporary
# that edition 2024 would keep alive in the returned model.
USE_BLOCK = """let vs = nn::VarStore::new(Device::Cpu);
let shape = {
    let block = residual_block(&(vs.root() / "block0"), 8);
    block.forward_t(&Tensor::ones([2, 8], (Kind::Float, Device::Cpu)), true).size()
};
shape"""


def test_edition_2021_code_compiles_and_edition_can_be_chosen(kernel):
    _, kc = kernel
    reply, messages = execute(kc, BLOCK)
    assert reply["status"] == "ok", reply
    reply, messages = execute(kc, USE_BLOCK)
    assert reply["status"] == "ok", reply
    assert result_text(messages) == "[2, 8]"

    # A user who wants 2024 says so; the function defined again then meets 2024's capture rules
    # (items defined before keep the edition they were defined in).
    reply, messages = execute(kc, ":edition 2024")
    assert reply["status"] == "ok", reply
    assert stream_text(messages).startswith("Edition: 2024")
    reply, _ = execute(kc, BLOCK)
    assert reply["status"] == "ok", reply
    reply, _ = execute(kc, USE_BLOCK.replace("block0", "block1"))
    assert reply["status"] == "error"
    assert "E0716" in "\n".join(reply["traceback"]) + reply["evalue"], reply

    reply, messages = execute(kc, ":edition 2021\n" + BLOCK)
    assert reply["status"] == "ok", reply
    reply, messages = execute(kc, USE_BLOCK.replace("block0", "block2"))
    assert reply["status"] == "ok", reply
    assert result_text(messages) == "[2, 8]"

    reply, _ = execute(kc, ":edition 2015")
    assert reply["status"] == "error"
    assert "2018, 2021, 2024" in reply["evalue"]


def test_a_cell_that_fails_to_compile_keeps_its_use_lines(kernel):
    _, kc = kernel
    reply, _ = execute(
        kc,
        "use std::collections::BTreeSet;\n"
        "let numbers: BTreeSet<i64> = [3, 1].into_iter().collect();\n"
        'let broken: i64 = "not a number";',
    )
    assert reply["status"] == "error"
    assert "E0308" in "\n".join(reply["traceback"])
    assert "`use` lines were kept" in "\n".join(reply["traceback"])
    reply, messages = execute(kc, "BTreeSet::<i64>::new().len()")
    assert reply["status"] == "ok", reply
    assert result_text(messages) == "0"

    # A `use` of what the failed cell defined cannot be kept; the error says so.
    reply, _ = execute(kc, "mod shapes { pub fn square(x: i64) -> i64 { x * x } }\n"
                           "use shapes::square;\nlet wrong: String = square(2);")
    assert reply["status"] == "error"
    assert "were not kept either" in "\n".join(reply["traceback"])


def test_a_model_of_impl_trait_type_is_kept_for_later_cells(kernel):
    """`let model = residual_block(..)` has type `impl ModuleT`, which evcxr cannot keep: the
    kernel keeps it boxed, and later cells use and train it as they would the model itself."""
    _, kc = kernel
    reply, _ = execute(kc, BLOCK)
    assert reply["status"] == "ok", reply
    reply, messages = execute(
        kc,
        "use tch::nn::OptimizerConfig;\n"
        "let vs = nn::VarStore::new(Device::Cpu);\n"
        "let model = residual_block(&(vs.root() / \"kept\"), 8);\n"
        "let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();",
    )
    assert reply["status"] == "ok", reply
    assert "kept as `tchmem::boxed::DynModuleT`" in stream_text(messages, "stderr")
    reply, messages = execute(
        kc,
        "let xs = Tensor::ones([2, 8], (Kind::Float, Device::Cpu));\n"
        "let before = xs.apply_t(&model, false);\n"
        "opt.backward_step(&xs.apply_t(&model, true).square().sum(Kind::Float));\n"
        "(before.size(), before.equal(&xs.apply_t(&model, false)))",
    )
    assert reply["status"] == "ok", reply
    assert result_text(messages) == "([2, 8], false)"


def test_closures_bound_at_a_cells_top_level_are_kept_for_later_cells(kernel):
    """A closure's type cannot be written, so evcxr cannot keep it: the kernel asks the compiler
    its signature and whether it is Fn or FnMut, and keeps it boxed (untyped parameters typed as
    the compiler inferred them); later cells call it as they would the closure."""
    _, kc = kernel
    reply, messages = execute(
        kc,
        "use tch::{Device, Kind, Tensor};\n"
        "let scale = 3.0;\n"
        "let scaled = move |x: &Tensor, shift| -> Tensor { x * scale + shift };\n"
        "let _ = scaled(&Tensor::ones([2], (Kind::Float, Device::Cpu)), 1.5);\n"
        "let mut calls = 0;\n"
        "let mut count = move || { calls += 1; calls };",
    )
    assert reply["status"] == "ok", reply
    stderr = stream_text(messages, "stderr")
    assert "kept as `Box<dyn Fn(&tch::Tensor, f64) -> tch::Tensor>`" in stderr, stderr
    assert "kept as `Box<dyn FnMut() -> i32>`" in stderr, stderr
    reply, messages = execute(
        kc,
        "let ys = scaled(&Tensor::ones([2], (Kind::Float, Device::Cpu)), 0.5);\n"
        "count();\n"
        "(Vec::<f32>::try_from(ys).unwrap(), count())",
    )
    assert reply["status"] == "ok", reply
    assert result_text(messages) == "([3.5, 3.5], 2)"

    # A closure whose parameter types nothing says: the compiler cannot name them either, and
    # says what to write.
    reply, _ = execute(kc, "let unknown = |x| x;")
    assert reply["status"] == "error"
    assert "explicit type" in "\n".join(reply["traceback"]), reply


def test_closures_over_the_cells_data_are_moved_and_kept_and_earlier_variables_stay(kernel):
    """tch-rs's gan example, pasted into a cell: closures that borrow the cell's dataset
    (`let random_batch_images = || { … images.index_select(…) … };`). rustc refuses to keep a
    borrowing closure (E0373); the kernel moves them, says so, and keeps them boxed. A closure
    that moves an earlier cell's variable is kept too, and asking the compiler about it (its
    probes) moves nothing out of the session: a probe that compiled used to take the variable
    with it."""
    _, kc = kernel
    reply, messages = execute(
        kc,
        "use tch::{kind, Kind, Tensor};\n"
        "let images = Tensor::ones([8, 3], kind::FLOAT_CPU);\n"
        "let train_size = images.size()[0];\n"
        "let random_batch = || {\n"
        "    let index = Tensor::randint(train_size, [4], kind::INT64_CPU);\n"
        "    images.index_select(0, &index).sum(Kind::Float).double_value(&[])\n"
        "};",
    )
    assert reply["status"] == "ok", reply
    stderr = stream_text(messages, "stderr")
    assert "cannot borrow the cell's variables: `random_batch` now run as `move`" in stderr, stderr
    assert "kept as `Box<dyn Fn() -> f64>`" in stderr, stderr
    reply, messages = execute(kc, "(random_batch(), train_size)")
    assert reply["status"] == "ok", reply
    assert result_text(messages) == "(12.0, 8)"

    reply, _ = execute(kc, "let weights = vec![1.0f64, 2.0];")
    assert reply["status"] == "ok", reply
    reply, _ = execute(kc, "let total = move || weights.iter().sum::<f64>();")
    assert reply["status"] == "ok", reply
    reply, messages = execute(kc, "total()")
    assert reply["status"] == "ok", reply
    assert result_text(messages) == "3.0"

    # Where moving does not make the cell compile, the cell's own error stands.
    reply, _ = execute(kc, "let v = vec![1];\nlet h = || v.len();\nv.len()")
    assert reply["status"] == "error"
    assert "closure may outlive the current function" in reply["evalue"], reply


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 intrinsics")
def test_a_variable_of_a_type_the_cell_has_not_imported_is_typed_imported_and_kept(kernel):
    """The code analysis is not shown `std::arch` (src/session/analysis_std.rs: it halves the
    start's reading of core), so it cannot type a variable holding an intrinsic's value: the
    compiler names `__m128i`, which the cell has not imported; the kernel imports it as rustc
    suggests, says so, and a later cell uses the variable."""
    _, kc = kernel
    reply, messages = execute(kc, "let lanes = unsafe { std::arch::x86_64::_mm_set1_epi32(7) };")
    assert reply["status"] == "ok", reply
    stderr = stream_text(messages, "stderr")
    assert "the compiler names `lanes: __m128i`" in stderr, stderr
    assert "imported `std::arch::x86_64::__m128i`" in stderr, stderr
    reply, messages = execute(kc, "unsafe { std::arch::x86_64::_mm_cvtsi128_si32(lanes) }")
    assert reply["status"] == "ok", reply
    assert result_text(messages) == "7"


# The exploratory pattern: the batch in one cell, the model and its optimizer in the next, the
# loop alone after them, run once, then compared and estimated.
SPLIT_BATCH = "const BATCH_SIZE: i64 = 16;"
SPLIT_MODEL = """use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
let vs = nn::VarStore::new(Device::Cpu);
let net = nn::seq()
    .add(nn::linear(vs.root() / "l1", 8, 32, Default::default()))
    .add_fn(|x| x.relu())
    .add(nn::linear(vs.root() / "l2", 32, 4, Default::default()));
let mut opt = nn::Adam::default().build(&vs, 1e-2).unwrap();
fn weights(vs: &nn::VarStore) -> Vec<(String, Vec<f32>, bool)> {
    let mut all: Vec<_> = vs
        .variables()
        .into_iter()
        .map(|(name, t)| (name, Vec::<f32>::try_from(t.flatten(0, -1)).unwrap(), t.grad().defined()))
        .collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    all
}"""
SPLIT_LOOP = """for _ in 0..3 {
    let xs = Tensor::randn([BATCH_SIZE, 8], (Kind::Float, Device::Cpu));
    let ys = Tensor::randint(4, [BATCH_SIZE], (Kind::Int64, Device::Cpu));
    let loss = net.forward(&xs).cross_entropy_for_logits(&ys);
    opt.backward_step(&loss);
}"""
COMPARISON_MIME = "application/vnd.tchmem.comparison+json"


def test_a_loop_over_a_model_of_earlier_cells_is_compared_and_estimated_and_left_as_it_was(kernel):
    _, kc = kernel
    parameters = (8 * 32 + 32 + 32 * 4 + 4) * 4
    for cell in (SPLIT_BATCH, SPLIT_MODEL):
        reply, _ = execute(kc, cell)
        assert reply["status"] == "ok", (cell, reply)

    # Before any loop, %memestimate alone answers with the model's exact terms.
    reply, messages = execute(kc, "%memestimate")
    assert reply["status"] == "ok", reply
    (estimate,) = displayed(messages, ESTIMATE_MIME)
    assert estimate["parameters"] == estimate["gradients"] == parameters, estimate
    # Adam: two f32 moments per element and a 4-byte step per tensor.
    assert estimate["optimizer_state"] == 2 * parameters + 4 * 4, estimate
    assert "`vs`" in estimate["what"] and "optimizer `opt` (Adam" in estimate["what"], estimate
    reply, _ = execute(kc, "%memestimate --batch 64")
    assert reply["status"] == "error" and "--batch need a training cell" in reply["evalue"], reply

    for cell in (SPLIT_LOOP, "let before = weights(&vs);"):
        reply, _ = execute(kc, cell)
        assert reply["status"] == "ok", (cell, reply)

    # Both runs start from the notebook's weights (same seed, same first loss) with a fresh
    # optimizer each; the notebook's model and gradients are as they were after them.
    reply, messages = execute(kc, "%%optimize --optimizer sgd --compare 2\n" + SPLIT_LOOP, timeout=300)
    assert reply["status"] == "ok", reply
    (result,) = displayed(messages, COMPARISON_MIME)
    original, rewritten = result["original"]["losses"], result["rewritten"]["losses"]
    assert len(original) == len(rewritten) == 2
    assert abs(original[0] - rewritten[0]) <= 1e-6, (original, rewritten)
    code = "".join(d["text/markdown"] for d in
                   [m["data"] for m in outputs(messages, "display_data")] if "text/markdown" in d)
    assert "the optimizer `opt` is built in cell [" in code, code
    reply, messages = execute(kc, "weights(&vs) == before")
    assert reply["status"] == "ok", reply
    assert result_text(messages) == "true"

    # Checkpointing a model an earlier cell built: rebuilt on a store of its own with the
    # notebook's weights copied in, so both runs give the same losses; the model is untouched.
    reply, messages = execute(kc, "%%optimize --checkpoint --compare 2\n" + SPLIT_LOOP, timeout=300)
    assert reply["status"] == "ok", (reply["evalue"], stream_text(messages))
    (result,) = displayed(messages, COMPARISON_MIME)
    original, rewritten = result["original"]["losses"], result["rewritten"]["losses"]
    assert max(abs(a - b) for a, b in zip(original, rewritten)) <= 1e-6, (original, rewritten)
    reply, messages = execute(kc, "weights(&vs) == before")
    assert result_text(messages) == "true"

    # %memestimate alone: the batch const of the first cell is the batch, the model is kept.
    reply, messages = execute(kc, "%memestimate", timeout=300)
    assert reply["status"] == "ok", reply
    (estimate,) = displayed(messages, ESTIMATE_MIME)
    assert "BATCH_SIZE = 16" in estimate["what"] and "Adam" in estimate["what"], estimate
    assert estimate["parameters"] == parameters, estimate
    reply, messages = execute(kc, "weights(&vs) == before")
    assert result_text(messages) == "true"

    # The notebook's own optimizer still steps its model.
    reply, messages = execute(kc, SPLIT_LOOP + "\nweights(&vs) == before")
    assert reply["status"] == "ok", reply
    assert result_text(messages) == "false"


# One training step of a small conv net, its operators recorded (what `%memestimate`'s trials
# do on CUDA), at a batch the next cells choose.
RECORD_STEP = """use tch::nn::{self, ModuleT, OptimizerConfig};
use tch::{Device, Kind, Tensor};
fn recorded_step(batch: i64) -> (u64, Vec<String>) {
    let vs = nn::VarStore::new(Device::Cpu);
    let conv = nn::conv2d(vs.root() / "conv", 3, 8, 3, Default::default());
    let fc = nn::linear(vs.root() / "fc", 8 * 6 * 6, 10, Default::default());
    let net = nn::seq_t().add(conv).add_fn(|x| x.relu().flatten(1, -1)).add(fc);
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let xs = Tensor::rand([batch, 3, 8, 8], (Kind::Float, Device::Cpu));
    let ys = Tensor::randint(10, [batch], (Kind::Int64, Device::Cpu));
    let ((), trace) = tchmem::op_trace::record(|| {
        opt.backward_step(&net.forward_t(&xs, true).cross_entropy_for_logits(&ys))
    })
    .unwrap();
    (trace.id, trace.ops.into_iter().map(|op| op.name).collect())
}
"""


def test_operators_recorded_in_one_cell_replay_in_another(kernel):
    """The estimate's replay runs in a cell of its own, whose copy of the runtime is not the
    trial's: the recordings live in the runtime's process-wide state."""
    _, kc = kernel
    reply, _ = execute(kc, RECORD_STEP)
    assert reply["status"] == "ok", reply
    reply, _ = execute(
        kc,
        "let (small, names) = recorded_step(4);\nlet (large, _) = recorded_step(8);\n"
        "let conv = names.iter().position(|n| n == \"aten::convolution_backward\").unwrap();",
    )
    assert reply["status"] == "ok", reply
    reply, messages = execute(
        kc,
        "let replayed = tchmem::op_trace::replay(small, large, (4, 8), 32, &[(conv, conv)]);\n"
        "format!(\"{:?} {:?}\", replayed.0.excess, replayed.0.error)",
    )
    assert reply["status"] == "ok", reply
    # It ran (no bytes are measured without CUDA).
    assert result_text(messages) == '"[Some(0)] None"', result_text(messages)


# tch::vision's models built by tch's own functions, as users build them: --checkpoint has no
# nn::seq_t() of the notebook's to rewrite, and rebuilds them from tch's source instead
# (scripts/check-vision-checkpoint runs eight of them; two small ones here).
VISION_MODELS = [("mobilenet", "v2"), ("squeezenet", "v1_1")]


@pytest.mark.parametrize("module,function", VISION_MODELS)
def test_checkpoint_rebuilds_a_tch_vision_model_from_tchs_source(kernel, module, function):
    _, kc = kernel
    build = f"""use tch::nn::{{self, ModuleT, OptimizerConfig}};
use tch::{{Device, Kind, Tensor}};
use tch::vision::{module};
let vision_vs = nn::VarStore::new(Device::Cpu);
let vision_net = {module}::{function}(&vision_vs.root(), 10);
let mut vision_opt = nn::Sgd::default().build(&vision_vs, 0.01).unwrap();"""
    reply, _ = execute(kc, build, timeout=300)
    assert reply["status"] == "ok", reply
    loop = """for _ in 0..2 {
    let xs = Tensor::rand([2, 3, 64, 64], (Kind::Float, Device::Cpu));
    let ys = Tensor::randint(10, [2], (Kind::Int64, Device::Cpu));
    let loss = vision_net.forward_t(&xs, true).cross_entropy_for_logits(&ys);
    vision_opt.backward_step(&loss);
}"""
    reply, messages = execute(kc, "%%optimize --checkpoint --compare 2\n" + loop, timeout=300)
    assert reply["status"] == "ok", (reply.get("evalue"), stream_text(messages))
    (result,) = displayed(messages, COMPARISON_MIME)
    original, rewritten = result["original"]["losses"], result["rewritten"]["losses"]
    assert len(original) == len(rewritten) == 2
    assert max(abs(a - b) for a, b in zip(original, rewritten)) <= 1e-6, (original, rewritten)
    code = "".join(d["text/markdown"] for d in
                   [m["data"] for m in outputs(messages, "display_data")] if "text/markdown" in d)
    assert f"by `tch::vision::{module}::{function}` (tch-" in code, code
    assert f"src/vision/{module}.rs)" in code, code
    assert "tchmem::checkpoint::seq_t()" in code, code


# An optimizer written in the notebook, as tch-rs's custom-optimizer example writes its
# SparseAdam: a type of its own over the store's variables, with a state and a step count.
WRITTEN_OPTIMIZER = """use std::sync::{Arc, Mutex};
use tch::nn::{self, Module, VarStore, Variables};
use tch::{no_grad, Device, Kind, Tensor};

struct Momentum {
    vars: Arc<Mutex<Variables>>,
    velocity: Vec<Tensor>,
    lr: f64,
    steps: usize,
}

impl Momentum {
    fn new(vs: &VarStore, lr: f64) -> Momentum {
        let vars = vs.variables_.clone();
        let velocity =
            vars.lock().unwrap().trainable_variables.iter().map(|v| v.tensor.zeros_like()).collect();
        Momentum { vars, velocity, lr, steps: 0 }
    }

    fn zero_grad(&mut self) {
        for var in &mut self.vars.lock().unwrap().trainable_variables {
            var.tensor.zero_grad();
        }
    }

    fn step(&mut self) {
        self.steps += 1;
        no_grad(|| {
            let mut vars = self.vars.lock().unwrap();
            for (var, velocity) in vars.trainable_variables.iter_mut().zip(&mut self.velocity) {
                *velocity *= 0.9;
                *velocity += var.tensor.grad();
                var.tensor -= &*velocity * self.lr;
            }
        });
    }
}

fn small_net(vs: &nn::Path) -> impl Module {
    nn::seq()
        .add(nn::linear(vs / "l1", 8, 16, Default::default()))
        .add_fn(|xs| xs.relu())
        .add(nn::linear(vs / "l2", 16, 4, Default::default()))
}"""
WRITTEN_MODEL = """let own_vs = VarStore::new(Device::Cpu);
let own_net = small_net(&own_vs.root());
let mut own_opt = Momentum::new(&own_vs, 0.05);
let own_data = Tensor::rand([64, 8], (Kind::Float, Device::Cpu));"""
WRITTEN_LOOP = """let batch_size = 16;
for _ in 0..3 {
    let xs = own_data.narrow(0, 0, batch_size);
    let loss = own_net.forward(&xs).pow_tensor_scalar(2).mean(Kind::Float);
    own_opt.zero_grad();
    loss.backward();
    own_opt.step();
}"""


def test_an_optimizer_the_notebook_wrote_is_built_afresh_by_the_magics_and_kept_as_it_was(kernel):
    _, kc = kernel
    for cell in (WRITTEN_OPTIMIZER, WRITTEN_MODEL):
        reply, _ = execute(kc, cell, timeout=300)
        assert reply["status"] == "ok", (cell, reply)
    # Before any loop: the model's terms, the optimizer named and its state not counted.
    reply, messages = execute(kc, "%memestimate")
    assert reply["status"] == "ok", reply
    (estimate,) = displayed(messages, ESTIMATE_MIME)
    assert "optimizer `own_opt` (`Momentum`, cell [" in estimate["what"], estimate
    assert estimate["optimizer_state"] is None, estimate
    assert estimate["parameters"] == (8 * 16 + 16 + 16 * 4 + 4) * 4, estimate

    for cell in (WRITTEN_LOOP, "let velocity = own_opt.velocity[0].copy();"):
        reply, _ = execute(kc, cell)
        assert reply["status"] == "ok", (cell, reply)
    # Each side of --compare steps a Momentum of its own from the same start; the notebook's
    # keeps its step count and velocity.
    reply, messages = execute(kc, "%%optimize --amp bf16 --compare 2\n" + WRITTEN_LOOP, timeout=300)
    assert reply["status"] == "ok", (reply.get("evalue"), stream_text(messages))
    (result,) = displayed(messages, COMPARISON_MIME)
    original, rewritten = result["original"]["losses"], result["rewritten"]["losses"]
    assert abs(original[1] - rewritten[1]) <= 0.05 * abs(original[1]), (original, rewritten)
    reply, messages = execute(kc, "(own_opt.steps, own_opt.velocity[0].equal(&velocity))")
    assert result_text(messages) == "(3, true)", result_text(messages)

    # A model beside it is rebuilt for --checkpoint, the optimizer built again on its store.
    reply, messages = execute(kc, "%%optimize --checkpoint --show\n" + WRITTEN_LOOP)
    assert reply["status"] == "ok", reply
    # A swap of tch's optimizers names it instead of finding none.
    reply, _ = execute(kc, "%%optimize --optimizer lion --show\n" + WRITTEN_LOOP)
    assert reply["status"] == "error" and reply["ename"] == "RewriteRefused", reply
    assert "`own_opt` (a `Momentum`, built in cell [" in reply["evalue"], reply["evalue"]
    # Its trials say whose state the estimate leaves in the line.
    reply, messages = execute(kc, "%memestimate\n" + WRITTEN_LOOP, timeout=300)
    assert reply["status"] == "ok", reply
    (estimate,) = displayed(messages, ESTIMATE_MIME)
    assert "Momentum (the notebook's)" in estimate["what"], estimate
    assert estimate["optimizer_state"] is None, estimate
    reply, messages = execute(kc, "own_opt.steps")
    assert result_text(messages) == "3", result_text(messages)

    # Built in the training cell itself, it is named the same way (not "found none").
    own_cell = "let mut own_opt = Momentum::new(&own_vs, 0.05);\n" + WRITTEN_LOOP
    reply, _ = execute(kc, "%%optimize --optimizer lion --show\n" + own_cell)
    assert reply["status"] == "error" and reply["ename"] == "RewriteRefused", reply
    assert "`own_opt` (a `Momentum`, built in cell [" in reply["evalue"], reply["evalue"]

    # Built by a function of the notebook that builds tch's Adam: followed, its state counted.
    reply, _ = execute(
        kc,
        "use tch::nn::OptimizerConfig;\n"
        "fn make_opt(vs: &VarStore) -> nn::Optimizer {\n"
        "    nn::Adam::default().build(vs, 1e-3).unwrap()\n}\n"
        "let mut own_opt = make_opt(&own_vs);",
    )
    assert reply["status"] == "ok", reply
    parameters = (8 * 16 + 16 + 16 * 4 + 4) * 4
    reply, messages = execute(kc, "%memestimate\n" + WRITTEN_LOOP, timeout=300)
    assert reply["status"] == "ok", reply
    (estimate,) = displayed(messages, ESTIMATE_MIME)
    assert "Adam" in estimate["what"] and "SGD" not in estimate["what"], estimate
    # Adam's two moments, and its step counts.
    assert 2 * parameters <= estimate["optimizer_state"] <= 2 * parameters + 64, estimate


# Fine-tuning as tch-rs's transfer-learning example sets it up: a backbone on a store of its
# own, frozen, and a new head with its optimizer on another.
FROZEN_BACKBONE = """use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
let mut backbone_vs = nn::VarStore::new(Device::Cpu);
let backbone = nn::seq_t()
    .add(nn::linear(backbone_vs.root() / "b1", 8, 16, Default::default()))
    .add_fn(|x| x.relu())
    .add(nn::linear(backbone_vs.root() / "b2", 16, 16, Default::default()));
backbone_vs.freeze();
let head_vs = nn::VarStore::new(Device::Cpu);
let head = nn::linear(head_vs.root() / "head", 16, 4, Default::default());
let mut head_opt = nn::Adam::default().build(&head_vs, 1e-3)?;
let tune_data = Tensor::rand([64, 8], (Kind::Float, Device::Cpu));"""
FROZEN_LOOP = """let batch_size = 16;
for _ in 0..2 {
    let xs = tune_data.narrow(0, 0, batch_size);
    let loss = xs.apply_t(&backbone, false).apply(&head).pow_tensor_scalar(2).mean(Kind::Float);
    head_opt.backward_step(&loss);
    println!("backbone trains: {}", backbone_vs.trainable_variables()[0].requires_grad());
}"""


def test_a_frozen_backbone_stays_frozen_in_the_model_checkpointing_rebuilds(kernel):
    _, kc = kernel
    reply, _ = execute(kc, FROZEN_BACKBONE, timeout=300)
    assert reply["status"] == "ok", reply
    # The rebuilt backbone (a store of its own, the notebook's weights copied in) takes no
    # gradient, as the notebook's does: the two sides train the head alike.
    reply, messages = execute(kc, "%%optimize --checkpoint --compare 2\n" + FROZEN_LOOP, timeout=300)
    assert reply["status"] == "ok", (reply.get("evalue"), stream_text(messages))
    text = stream_text(messages)
    rewritten = text[text.index("── rewritten"):]
    assert rewritten.count("backbone trains: false") == 2, text
    assert "backbone trains: true" not in text, text
    reply, messages = execute(kc, "backbone_vs.trainable_variables().iter().any(|t| t.requires_grad())")
    assert result_text(messages) == "false", result_text(messages)
    # A backbone that shares its store with the head: --checkpoint cannot rebuild it alone, and
    # %memestimate --checkpoint says so, by name, before any trial.
    reply, _ = execute(kc, SHARED_BACKBONE, timeout=300)
    assert reply["status"] == "ok", reply
    reply, _ = execute(kc, "%memestimate --checkpoint\n" + SHARED_LOOP, timeout=300)
    assert reply["status"] == "error" and reply["ename"] == "RewriteRefused", reply
    assert "`shared_net` (cell [" in reply["evalue"], reply["evalue"]
    assert "shares its VarStore `shared_vs` with `shared_head`" in reply["evalue"], reply["evalue"]


SHARED_BACKBONE = """let shared_vs = nn::VarStore::new(Device::Cpu);
let shared_net = nn::seq_t().add(nn::linear(shared_vs.root() / "b", 8, 16, Default::default()));
let shared_head = nn::linear(shared_vs.root() / "head", 16, 4, Default::default());
let mut shared_opt = nn::Adam::default().build(&shared_vs, 1e-3)?;"""
SHARED_LOOP = """let batch_size = 16;
for _ in 0..2 {
    let xs = tune_data.narrow(0, 0, batch_size);
    let loss = xs.apply_t(&shared_net, false).apply(&shared_head).pow_tensor_scalar(2).mean(Kind::Float);
    shared_opt.backward_step(&loss);
}"""
