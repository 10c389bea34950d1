"""Per-cell memory records through the real kernel: categories of a watched model, the inline
summary, and the %memprofile / %memhistory magics (CPU: categories from tensor sizes)."""

from conftest import charts_in, execute, outputs, page_text, skip_on_cuda, stream_text

RECORD_MIME = "application/vnd.tchmem.record+json"


def memory_displays(messages):
    return [d for d in outputs(messages, "display_data") if RECORD_MIME in d["data"]]


def category_bytes(record, name):
    return sum(c["bytes"] for c in record["categories"] if c["name"] == name)


def test_watched_model_categories_equal_its_tensor_bytes(kernel):
    _, kc = kernel
    skip_on_cuda(kc)
    execute(kc, "%memprofile auto")
    code = """
use tch::nn::Module;
let mem_vs: tch::nn::VarStore = tch::nn::VarStore::new(tch::Device::Cpu);
let mem_model: tch::nn::Linear = tch::nn::linear(mem_vs.root(), 100, 30, Default::default());
tchmem::watch(&mem_vs);
"""
    reply, messages = execute(kc, code)
    assert reply["status"] == "ok", reply
    (display,) = memory_displays(messages)
    record = display["data"][RECORD_MIME]
    parameters = (100 * 30 + 30) * 4
    assert record["device"] == "cpu"
    assert category_bytes(record, "parameters") == parameters
    assert category_bytes(record, "gradients") == 0
    assert display["data"]["text/plain"].startswith("cpu: parameters 11.8 KiB")
    html = display["data"]["text/html"]
    charts = charts_in(html)
    assert len(charts) == 1 and "parameters" in charts[0], html

    code = """
let mem_x: tch::Tensor = tch::Tensor::ones([8, 100], (tch::Kind::Float, tch::Device::Cpu));
tchmem::watch_batch(&mem_x);
mem_model.forward(&mem_x).sum(tch::Kind::Float).backward();
"""
    reply, messages = execute(kc, code)
    assert reply["status"] == "ok", reply
    record = memory_displays(messages)[0]["data"][RECORD_MIME]
    assert category_bytes(record, "gradients") == parameters
    assert category_bytes(record, "input_batch") == 8 * 100 * 4
    # On CPU every category comes from tensor sizes, so all are exact; the record says what is
    # CUDA-only.
    assert all(c["exact"] for c in record["categories"])
    assert any("CUDA-only" in note for note in record["notes"])


def test_memprofile_modes(kernel):
    _, kc = kernel
    reply, messages = execute(kc, "%memprofile off")
    assert reply["status"] == "ok" and "off" in stream_text(messages)
    code = "let mem_vs2: tch::nn::VarStore = tch::nn::VarStore::new(tch::Device::Cpu);\n" \
           "let _l: tch::nn::Linear = tch::nn::linear(mem_vs2.root(), 4, 4, Default::default());\n" \
           "tchmem::watch(&mem_vs2);"
    reply, messages = execute(kc, code)
    assert reply["status"] == "ok" and memory_displays(messages) == []
    reply, messages = execute(kc, "%memprofile always\n1 + 1")
    assert reply["status"] == "ok" and len(memory_displays(messages)) == 1
    reply, messages = execute(kc, "%memprofile auto\n2 + 2")
    assert reply["status"] == "ok" and memory_displays(messages) == []


def test_memhistory_lists_every_recorded_cell(kernel):
    _, kc = kernel
    skip_on_cuda(kc)
    reply, messages = execute(kc, "%memhistory")
    assert reply["status"] == "ok"
    (table,) = outputs(messages, "display_data")
    assert table["data"]["text/plain"].startswith("run  device")
    assert "cpu" in table["data"]["text/plain"] and "<table>" in table["data"]["text/html"]


def test_magics_explain_help_and_mistakes_and_the_kernel_continues(kernel):
    _, kc = kernel
    reply, messages = execute(kc, "%memprofile --help")
    assert reply["status"] == "ok" and "Usage: %memprofile [MODE]" in page_text(reply)
    reply, _ = execute(kc, "%memprofile sometimes")
    assert reply["status"] == "error" and reply["ename"] == "MagicError"
    assert "possible values: auto, always, off" in reply["evalue"]
    reply, _ = execute(kc, "%memprofile --fast")
    assert reply["status"] == "error" and "--fast" in reply["evalue"]
    reply, _ = execute(kc, "%nosuchmagic")
    assert reply["status"] == "error" and "%memprofile" in reply["evalue"]
    reply, messages = execute(kc, "40 + 2")
    assert reply["status"] == "ok"


def test_memsummary_shows_the_allocator_counters_or_says_they_are_cuda_only(kernel):
    _, kc = kernel
    skip_on_cuda(kc)
    reply, messages = execute(kc, "%memsummary")
    assert reply["status"] == "ok"
    (table,) = outputs(messages, "display_data")
    text = table["data"]["text/plain"]
    assert "after run" in text and "<table>" in table["data"]["text/html"]
    assert "CUDA-only" in text  # CI has no GPU; on CUDA the counters are listed instead
    assert "cell ran for" in text and "recording took" in text, text
    reply, messages = execute(kc, "%memsummary --help")
    assert reply["status"] == "ok" and "Usage: %memsummary" in page_text(reply)


def test_var_stores_are_watched_without_being_told(kernel):
    _, kc = kernel
    skip_on_cuda(kc)
    execute(kc, "%memprofile auto")
    code = """
let auto_vs: tch::nn::VarStore = tch::nn::VarStore::new(tch::Device::Cpu);
let _auto_layer: tch::nn::Linear = tch::nn::linear(auto_vs.root(), 10, 10, Default::default());
"""
    reply, messages = execute(kc, code)
    assert reply["status"] == "ok", reply
    (display,) = memory_displays(messages)
    record = display["data"][RECORD_MIME]
    # Other tests' stores may be watched too; this one's 110 floats must be among the parameters.
    assert category_bytes(record, "parameters") >= (10 * 10 + 10) * 4
    before = category_bytes(record, "parameters")
    # Binding the name anew watches the new store (the old one is dropped).
    code = """
let auto_vs: tch::nn::VarStore = tch::nn::VarStore::new(tch::Device::Cpu);
let _auto_layer: tch::nn::Linear = tch::nn::linear(auto_vs.root(), 20, 10, Default::default());
"""
    reply, messages = execute(kc, code)
    assert reply["status"] == "ok", reply
    record = memory_displays(messages)[0]["data"][RECORD_MIME]
    assert category_bytes(record, "parameters") == before + (20 * 10 + 10 - 110) * 4


def test_an_allocation_too_large_for_the_machine_is_an_out_of_memory_error(kernel):
    _, kc = kernel
    # 2^50 f32 elements (4 PiB): more than any address space; libtorch's CPU allocator refuses.
    code = "let oom_t: tch::Tensor = tch::Tensor::zeros([1i64 << 50], (tch::Kind::Float, tch::Device::Cpu));"
    reply, messages = execute(kc, code)
    assert reply["status"] == "error"
    assert reply["ename"] == "OutOfMemory", reply
    assert "CPU allocator" in reply["evalue"] and "%%optimize" in reply["evalue"]
    assert any("can't allocate memory" in line for line in reply["traceback"])
    # The kernel is still there, with its earlier variables.
    reply, _ = execute(kc, "let oom_after: i32 = 1; oom_after")
    assert reply["status"] == "ok"
