"""tch code as tch users write it: tch-rs's own examples (tests/corpus/, one notebook each, data made
in the notebook), with every magic put on the first line of the example's training cell, through a
real kernel on CPU. The outcome of each (works, or refused and why) must be the one docs/corpus.md
lists: the table there is what a user is told, and this test keeps it true. Before the magics,
`%memestimate` alone gives each model's fixed terms (parameters, gradients, optimizer state,
frozen variables such as BatchNorm's running statistics), which must equal the architecture's
own counts, worked out below from its layers (issue 20's CPU goal: these terms exact for every
family).

`python tests/test_corpus.py` runs the same and prints the table (to update docs/corpus.md)."""

import functools
import re
import sys
import tempfile
from pathlib import Path

import nbformat
import pytest
from jupyter_client.manager import start_new_kernel

from conftest import ESTIMATE_MIME, FIRST_CELL_TIMEOUT, KERNEL_NAME, displayed, execute

CORPUS = Path(__file__).parent / "corpus"
TABLE = Path(__file__).parent.parent / "docs" / "corpus.md"
EXAMPLES = sorted(p.stem for p in CORPUS.glob("*.ipynb"))

# Each magic as a user writes it on the first line of the training cell ("" runs it as written).
MAGICS = [
    "",
    "%%optimize --checkpoint --show",
    "%%optimize --amp bf16 --show",
    "%%optimize --accumulate 2 --show",
    "%%optimize --optimizer adafactor --show",
    "%%optimize --checkpoint --compare 2",
    "%%optimize --amp bf16 --compare 2",
    "%%optimize --accumulate 2 --compare 2",
    "%%optimize --optimizer adafactor --compare 2",
    "%memestimate",
    "%memfit",
    "%%memprofile",
    "%%optimize --fused-loss --show",
    "%%optimize --step-in-backward --show",
]
# Trials and full runs of a training cell on CPU: the examples' sizes are kept small.
MAGIC_TIMEOUT = 600
F32 = 4


def conv(k, c_in, c_out, bias=True):
    """Elements and tensors of a k×k convolution."""
    return k * k * c_in * c_out + (c_out if bias else 0), 1 + bias


def linear(n_in, n_out, bias=True):
    return n_in * n_out + (n_out if bias else 0), 1 + bias


def norm(channels):
    """BatchNorm's or LayerNorm's weight and bias (BatchNorm's running statistics apart)."""
    return 2 * channels, 2


def total(*layers):
    """(elements, tensors) of layers given as (elements, tensors)."""
    return sum(e for e, _ in layers), sum(t for _, t in layers)


def resnet(blocks, classes):
    """tch::vision::resnet's basic-block nets (resnet18: 2 blocks a stage, resnet34: 3, 4, 6, 3):
    (trainable (elements, tensors), BatchNorm channels)."""
    layers, channels, c_in = [conv(7, 3, 64, False), norm(64)], 64, 64
    for (c_out, stride), count in zip(((64, 1), (128, 2), (256, 2), (512, 2)), blocks):
        for block in range(count):
            first = c_in if block == 0 else c_out
            layers += [conv(3, first, c_out, False), norm(c_out), conv(3, c_out, c_out, False), norm(c_out)]
            channels += 2 * c_out
            if block == 0 and (stride != 1 or first != c_out):
                layers += [conv(1, first, c_out, False), norm(c_out)]
                channels += c_out
        c_in = c_out
    return total(*layers, linear(512, classes)), channels


def fast_resnet():
    """cifar_resnet's fast_resnet: conv_bn blocks (3x3 without bias, BatchNorm)."""
    blocks = [(3, 64), (64, 128), (128, 128), (128, 128), (128, 256), (256, 512), (512, 512), (512, 512)]
    layers = [layer for c_in, c_out in blocks for layer in (conv(3, c_in, c_out, False), norm(c_out))]
    return total(*layers, linear(512, 10)), sum(c_out for _, c_out in blocks)


def vgg(widths, image, classes):
    layers, channels, c_in = [], 0, 3
    for width in widths:
        layers += [conv(3, c_in, width), norm(width), conv(3, width, width), norm(width)]
        channels += 2 * width
        c_in = width
    side = image // 16
    return total(*layers, linear(c_in * side * side, 256), linear(256, classes)), channels


def gpt_block(n_embd, fused_qkv):
    attention = [linear(n_embd, 3 * n_embd)] if fused_qkv else [linear(n_embd, n_embd)] * 3
    return [norm(n_embd), norm(n_embd), *attention, linear(n_embd, n_embd),
            linear(n_embd, 4 * n_embd), linear(4 * n_embd, n_embd)]


# The characters of the text char_rnn and min_gpt make (TextData's labels).
TEXT_LABELS = len(set("First Citizen: Before we proceed any further, hear me speak. All: Speak, speak.\n"))


def adam(elements, tensors):
    """Two f32 moments per element and a 4-byte step per tensor (OptimizerRule::Adam)."""
    return 2 * F32 * elements + F32 * tensors


def sgd_momentum(elements, tensors):
    return F32 * elements


def no_optimizer(elements, tensors):
    return 0


def not_counted(elements, tensors):
    """An optimizer the notebook wrote: no rule counts its state, and the estimate says so."""
    return None


def _terms():
    """{example: (trainable (elements, tensors), frozen elements, optimizer state rule)} for the
    models of the examples' set-up cells, from their layers."""
    r18, r18_channels = resnet((2, 2, 2, 2), 10)
    r34, r34_channels = resnet((3, 4, 6, 3), 10)
    fast, fast_channels = fast_resnet()
    net, vgg_channels = vgg([16, 32, 64, 128], 32, 10)
    lstm = (4 * 256 * (TEXT_LABELS + 256) + 8 * 256, 4)
    gru = (3 * 64 * (32 + 64) + 6 * 64, 4)
    min_gpt = total((TEXT_LABELS * 64, 1), (128 * 64, 1), norm(64), (TEXT_LABELS * 64, 1),
                    *gpt_block(64, False) * 2)
    tied_gpt = total((65 * 64, 1), (32 * 64, 1), norm(64), *gpt_block(64, True) * 2)
    return {
        # BatchNorm keeps a running mean and variance per channel: on the device, not trainable.
        "resnet18": (r18, 2 * r18_channels, sgd_momentum),
        "resnet34": (r34, 2 * r34_channels, sgd_momentum),
        # The backbone frozen: its variables and BatchNorm statistics held, only the head trains.
        "finetune": (linear(512, 10), r18[0] - linear(512, 10)[0] + 2 * r18_channels, adam),
        "cifar_resnet": (fast, 2 * fast_channels, sgd_momentum),
        "vgg": (net, 2 * vgg_channels, adam),
        "char_rnn": (total(lstm, linear(256, TEXT_LABELS)), 0, adam),
        "gru": (total((65 * 32, 1), gru, linear(64, 65)), 0, adam),
        # Its head's bias is made with zeros_no_train; its optimizer is built in the training cell.
        "min_gpt": (min_gpt, TEXT_LABELS, no_optimizer),
        "tied_gpt": (tied_gpt, 0, adam),
        "mnist_conv": (total(conv(5, 1, 32), conv(5, 32, 64), linear(1024, 1024), linear(1024, 10)), 0, adam),
        "mnist_nn": (total(linear(784, 128), linear(128, 10)), 0, adam),
        "custom_optimizer": (total(linear(784, 128), linear(128, 10)), 0, not_counted),
        # Two stores, each with its Adam: the generator's transposed convolutions and the
        # discriminator's convolutions (widths a sixteenth of the example's), no biases.
        "gan": (total(conv(4, 128, 64, False), norm(64), conv(4, 64, 32, False), norm(32),
                      conv(4, 32, 16, False), norm(16), conv(4, 16, 8, False), norm(8),
                      conv(4, 8, 3, False),
                      conv(4, 3, 8, False), conv(4, 8, 16, False), norm(16), conv(4, 16, 32, False),
                      norm(32), conv(4, 32, 64, False), norm(64), conv(4, 64, 1, False)),
                2 * (64 + 32 + 16 + 8) + 2 * (16 + 32 + 64), adam),
        "vae": (total(linear(784, 400), linear(400, 20), linear(400, 20), linear(20, 400), linear(400, 784)),
                0, adam),
    }


EXPECTED_TERMS = _terms()


def cells_of(example):
    """The example's set-up cells (before the training cell) and its training cell."""
    book = nbformat.read(CORPUS / f"{example}.ipynb", as_version=4)
    code = [c for c in book.cells if c.cell_type == "code"]
    (training,) = [c for c in code if "training" in c.metadata.get("tags", [])]
    setup = code[: code.index(training)]
    return [c.source for c in setup], training.source


def outcome(reply):
    """`works`, or `refused: <message>` / `<ename>: <message>` from an error reply."""
    if reply["status"] == "ok":
        return "works"
    name = "refused" if reply["ename"] in ("RewriteRefused", "NoTrainingCell") else reply["ename"]
    return f"{name}: {reply['evalue']}"


@functools.cache
def run_example(example):
    """({magic: outcome}, the estimate `%memestimate` alone gave after the set-up cells or None)
    for one example, in a kernel of its own (its cells' files in a temporary directory); run once
    for both tests of an example."""
    setup, training = cells_of(example)
    with tempfile.TemporaryDirectory(prefix="tchmem-corpus-") as cwd:
        km, kc = start_new_kernel(kernel_name=KERNEL_NAME, startup_timeout=120, cwd=cwd)
        try:
            for i, cell in enumerate(setup):
                reply, _ = execute(kc, cell, timeout=FIRST_CELL_TIMEOUT if i == 0 else MAGIC_TIMEOUT)
                assert reply["status"] == "ok", (example, cell, reply)
            reply, messages = execute(kc, "%memestimate", timeout=MAGIC_TIMEOUT)
            terms = displayed(messages, ESTIMATE_MIME)
            terms = terms[0] if reply["status"] == "ok" and terms else None
            results = {}
            for magic in MAGICS:
                code = f"{magic}\n{training}" if magic else training
                reply, _ = execute(kc, code, timeout=MAGIC_TIMEOUT)
                results[magic] = outcome(reply)
            # However the magics ended, the kernel is still there with the example's variables.
            reply, _ = execute(kc, "1 + 1")
            assert reply["status"] == "ok", (example, reply)
            return results, terms
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=True)


def expected_table():
    """{example: {magic: expected}} from docs/corpus.md's table."""
    rows = [line for line in TABLE.read_text().splitlines() if line.startswith("| `")]
    table = {}
    for row in rows:
        # A message may hold a pipe (a closure's `|x|`), escaped in the table.
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]
        example = cells[0].strip("`")
        assert len(cells) == 1 + len(MAGICS), row
        table[example] = dict(zip(MAGICS, cells[1:]))
    return table


def agrees(expected, got):
    """`works` is `works`; `refused: why` (or `Ename: why`) is an outcome of that kind whose message
    contains `why`."""
    if expected == "works":
        return got == "works"
    kind, _, why = expected.partition(": ")
    return got.startswith(kind + ":") and why.lower() in got.lower()


@pytest.mark.parametrize("example", EXAMPLES)
def test_every_magic_on_the_example_does_what_the_docs_say(example):
    expected = expected_table()[example]
    got, _ = run_example(example)
    wrong = {m: (expected[m], got[m]) for m in MAGICS if not agrees(expected[m], got[m])}
    assert not wrong, wrong


@pytest.mark.parametrize("example", sorted(EXPECTED_TERMS))
def test_the_models_fixed_terms_are_its_layers_counts(example):
    (elements, tensors), frozen, rule = EXPECTED_TERMS[example]
    _, terms = run_example(example)
    assert terms is not None, f"%memestimate alone gave no terms after {example}'s set-up cells"
    # "parameters" counts every variable of the store, the frozen ones included.
    assert terms["parameters"] == F32 * (elements + frozen), (terms, elements, frozen)
    assert terms["gradients"] == F32 * elements, terms
    assert terms["optimizer_state"] == rule(elements, tensors), terms


def short(result):
    """A table cell: `works`, or the kind and the message's first clause."""
    if result == "works":
        return result
    kind, _, message = result.partition(": ")
    # The magic's own preamble says nothing the column does not.
    message = re.sub(r"^(%%optimize did not rewrite this cell|%\w+ cannot vary this cell's batch"
                     r"|%\w+ runs the cell in trials): ", "", message)
    message = re.sub(r"^line \d+: ", "", message)
    first = re.split(r"(?<=[a-z)`])[;.]\s|\n", message)[0]
    return f"{kind}: {first[:120]}".replace("|", "\\|")


if __name__ == "__main__":
    import conftest

    conftest.pytest_configure(type("Config", (), {"addinivalue_line": lambda *a: None})())
    names = sys.argv[1:] or EXAMPLES
    header = ["example"] + [m or "as written" for m in MAGICS]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for example in names:
        results, _ = run_example(example)
        print(f"| `{example}` | " + " | ".join(short(results[m]) for m in MAGICS) + " |", flush=True)
