"""%%optimize through the real kernel: rewritten code shown and run, refusals that name what was
missing, bad flags, and --compare runs whose measurements show the rewrite kept the training
semantics (CPU: checkpointing gives the same losses; accumulation the same losses)."""

from conftest import charts_in, execute, outputs, page_text, stream_text

COMPARISON_MIME = "application/vnd.tchmem.comparison+json"

SETUP = """
use tch::{nn, nn::Module, nn::ModuleT, nn::OptimizerConfig, Device, Kind, Tensor};
let opt_batches: Vec<(Tensor, Tensor)> = (0..4)
    .map(|_| (Tensor::randn([32, 16], (Kind::Float, Device::Cpu)),
              Tensor::randn([32, 4], (Kind::Float, Device::Cpu))))
    .collect();
"""

# With dropout: checkpointing must replay the masks.
DROPOUT_LOOP = """
let vs = nn::VarStore::new(Device::Cpu);
let mut model = nn::seq_t();
for i in 0..4 {
    model = model
        .add(nn::linear(vs.root() / i, 16, 16, Default::default()))
        .add_fn(|x| x.tanh())
        .add_fn_t(|x, train| x.dropout(0.2, train));
}
model = model.add(nn::linear(vs.root() / "out", 16, 4, Default::default()));
let mut opt = nn::Adam::default().build(&vs, 1e-2).unwrap();
for (xs, ys) in opt_batches.iter() {
    let loss = model.forward_t(xs, true).mse_loss(ys, tch::Reduction::Mean);
    opt.backward_step(&loss);
}
println!("the loop ran");
"""

PLAIN_LOOP = """
let vs = nn::VarStore::new(Device::Cpu);
let model = nn::seq()
    .add(nn::linear(vs.root() / "a", 16, 32, Default::default()))
    .add_fn(|x| x.relu())
    .add(nn::linear(vs.root() / "b", 32, 4, Default::default()));
let mut opt = nn::Sgd { momentum: 0.9, ..Default::default() }.build(&vs, 1e-2).unwrap();
for (xs, ys) in opt_batches.iter() {
    let loss = model.forward(xs).mse_loss(ys, tch::Reduction::Mean);
    opt.zero_grad();
    loss.backward();
    opt.step();
}
"""

STRUCT_LOOP = """
#[derive(Debug)]
struct Net { l: nn::Linear }
impl Module for Net {
    fn forward(&self, x: &Tensor) -> Tensor { self.l.forward(x) }
}
let vs = nn::VarStore::new(Device::Cpu);
let net = Net { l: nn::linear(vs.root(), 16, 4, Default::default()) };
let mut opt = nn::Adam::default().build(&vs, 1e-2).unwrap();
for (xs, ys) in opt_batches.iter() {
    let loss = net.forward(xs).mse_loss(ys, tch::Reduction::Mean);
    opt.backward_step(&loss);
}
"""


def comparison(messages):
    (found,) = [d["data"][COMPARISON_MIME] for d in outputs(messages, "display_data")
                if COMPARISON_MIME in d["data"]]
    return found


def rewritten_code(messages):
    return "".join(d["data"]["text/markdown"] for d in outputs(messages, "display_data")
                   if "text/markdown" in d["data"])


def test_setup(kernel):
    _, kc = kernel
    reply, _ = execute(kc, SETUP)
    assert reply["status"] == "ok", reply


def test_help_and_bad_flags_explain_and_the_kernel_continues(kernel):
    _, kc = kernel
    reply, messages = execute(kc, "%%optimize --help\n" + PLAIN_LOOP)
    assert reply["status"] == "ok"
    help_text = page_text(reply)
    for flag in ("--checkpoint", "--amp", "--accumulate", "--optimizer", "--show", "--compare"):
        assert flag in help_text, help_text
    for bad, says in (("--amp fp8", "bf16"), ("--accumulate 0", "at least 2"),
                      ("--optimizer adam9", "adafactor"), ("--show", "at least one rewrite")):
        reply, _ = execute(kc, f"%%optimize {bad}\n" + PLAIN_LOOP)
        assert reply["status"] == "error" and reply["ename"] == "MagicError", reply
        assert says in reply["evalue"], (bad, reply["evalue"])
    reply, _ = execute(kc, "%%optimize --checkpoint\n")
    assert reply["status"] == "error" and "nothing after" in reply["evalue"]
    reply, _ = execute(kc, "1 + 1")
    assert reply["status"] == "ok"


def test_a_loop_it_cannot_rewrite_is_refused_with_what_was_missing_and_where(kernel):
    _, kc = kernel
    reply, messages = execute(kc, "%%optimize --checkpoint\n" + STRUCT_LOOP)
    assert reply["status"] == "error" and reply["ename"] == "RewriteRefused", reply
    assert "nn::seq()" in reply["evalue"] and "Nothing was run" in reply["evalue"]
    reply, _ = execute(kc, "%%optimize --accumulate 2\nlet a = 1;\n")
    assert reply["status"] == "error" and reply["ename"] == "RewriteRefused", reply
    assert "line " in reply["evalue"] or "backward" in reply["evalue"], reply["evalue"]


def test_show_displays_the_rewrite_without_running_it(kernel):
    _, kc = kernel
    reply, messages = execute(kc, "%%optimize --optimizer lion --show\n" + DROPOUT_LOOP)
    assert reply["status"] == "ok", reply
    code = rewritten_code(messages)
    assert "```rust" in code and "tchmem::optim::Lion" in code, code
    assert "the loop ran" not in stream_text(messages)


def test_compare_of_checkpointing_gives_the_same_losses_and_times_both(kernel):
    _, kc = kernel
    reply, messages = execute(kc, "%%optimize --checkpoint 2 --compare 3\n" + DROPOUT_LOOP)
    assert reply["status"] == "ok", reply
    result = comparison(messages)
    original, rewritten = result["original"], result["rewritten"]
    assert len(original["losses"]) == len(rewritten["losses"]) == 3
    assert all(t > 0 for t in original["step_seconds"] + rewritten["step_seconds"])
    # Same seed, same masks replayed: checkpointing does not change training.
    diff = max(abs(a - b) for a, b in zip(original["losses"], rewritten["losses"]))
    assert diff <= 1e-6, (original["losses"], rewritten["losses"])
    html = [d["data"]["text/html"] for d in outputs(messages, "display_data")
            if COMPARISON_MIME in d["data"]][0]
    assert len(charts_in(html)) == 1, html
    if original["peak_allocated"] is None:  # CUDA-only; the table says so
        assert "CUDA-only" in html
    else:
        assert "Peak memory" in html and rewritten["peak_allocated"] > 0


def test_compare_of_accumulation_gives_the_same_losses(kernel):
    _, kc = kernel
    reply, messages = execute(kc, "%%optimize --accumulate 4 --compare 4\n" + PLAIN_LOOP)
    assert reply["status"] == "ok", reply
    result = comparison(messages)
    a, b = result["original"]["losses"], result["rewritten"]["losses"]
    assert len(a) == len(b) == 4
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5, (a, b)


def test_without_show_or_compare_the_rewritten_cell_runs_and_keeps_its_variables(kernel):
    _, kc = kernel
    reply, messages = execute(kc, "%%optimize --optimizer adamw8bit --amp bf16\n" + DROPOUT_LOOP)
    assert reply["status"] == "ok", reply
    assert "the loop ran" in stream_text(messages)
    assert "tchmem::amp::autocast" in rewritten_code(messages)
    reply, messages = execute(kc, "opt.name().to_string() + \" \" + &opt.state_bytes().to_string()")
    assert reply["status"] == "ok", reply
    text = [r["data"]["text/plain"] for r in outputs(messages, "execute_result")][0]
    name, state = text.strip('"').split()
    assert name == "AdamW8bit" and int(state) > 0, text


def test_a_checkpointed_forward_in_one_cell_runs_backward_in_another(kernel):
    """Every cell links its own copy of the runtime. A checkpointed forward in one cell, another
    cell's own checkpoint in between, then the backward in a third: the rerun must still find the
    first cell's segments (it failed with 'saved different tensors' when the last copy to run a
    checkpoint answered for all of them), and the gradients must equal plain ones."""
    _, kc = kernel
    execute(kc, SETUP)
    reply, messages = execute(kc, """
let cross_vs = nn::VarStore::new(Device::Cpu);
let cross_model: Box<dyn Module> = Box::new(tchmem::checkpoint::seq()
    .add(nn::linear(cross_vs.root() / "a", 16, 16, Default::default()))
    .add_fn(|x| x.tanh())
    .add(nn::linear(cross_vs.root() / "b", 16, 16, Default::default()))
    .add_fn(|x| x.tanh())
    .segments(2));
let cross_x = Tensor::randn([8, 16], (Kind::Float, Device::Cpu));
let cross_loss = cross_model.forward(&cross_x).square().sum(Kind::Float);
""")
    assert reply["status"] == "ok", reply.get("evalue", reply)
    reply, messages = execute(kc, """
let other = Tensor::randn([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
tchmem::checkpoint::checkpoint(|t| t.sin(), &other).sum(Kind::Float).backward();
println!("another cell's checkpoint ran");
""")
    assert "another cell's checkpoint ran" in stream_text(messages), reply.get("evalue", reply)
    reply, messages = execute(kc, """
cross_loss.backward();
let v = cross_vs.variables();
let h = (cross_x.matmul(&v["a.weight"].tr()) + &v["a.bias"]).tanh();
let plain = (h.matmul(&v["b.weight"].tr()) + &v["b.bias"]).tanh().square().sum(Kind::Float);
let expected = Tensor::run_backward(&[plain], &[&v["a.weight"]], false, false);
let diff = (v["a.weight"].grad() - &expected[0]).abs().max().double_value(&[]);
println!("gradient difference {diff:e}");
""")
    assert reply["status"] == "ok", reply.get("evalue", reply)
    text = stream_text(messages)
    assert "gradient difference" in text, text
    diff = float(text.split("gradient difference")[1].split()[0])
    assert diff <= 1e-6, text
