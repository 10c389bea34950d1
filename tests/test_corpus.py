"""tch code as tch users write it: tch-rs's own examples (tests/corpus/, one notebook each, data made
in the notebook), with every magic put on the first line of the example's training cell, through a
real kernel on CPU. The outcome of each (works, or refused and why) must be the one docs/corpus.md
lists: the table there is what a user is told, and this test keeps it true.

`python tests/test_corpus.py` runs the same and prints the table (to update docs/corpus.md)."""

import re
import sys
import tempfile
from pathlib import Path

import nbformat
import pytest
from jupyter_client.manager import start_new_kernel

from conftest import FIRST_CELL_TIMEOUT, KERNEL_NAME, execute

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


def run_example(example):
    """{magic: outcome} for one example, in a kernel of its own (its cells' files in a temporary
    directory)."""
    setup, training = cells_of(example)
    with tempfile.TemporaryDirectory(prefix="tchmem-corpus-") as cwd:
        km, kc = start_new_kernel(kernel_name=KERNEL_NAME, startup_timeout=120, cwd=cwd)
        try:
            for i, cell in enumerate(setup):
                reply, _ = execute(kc, cell, timeout=FIRST_CELL_TIMEOUT if i == 0 else MAGIC_TIMEOUT)
                assert reply["status"] == "ok", (example, cell, reply)
            results = {}
            for magic in MAGICS:
                code = f"{magic}\n{training}" if magic else training
                reply, _ = execute(kc, code, timeout=MAGIC_TIMEOUT)
                results[magic] = outcome(reply)
            # However the magics ended, the kernel is still there with the example's variables.
            reply, _ = execute(kc, "1 + 1")
            assert reply["status"] == "ok", (example, reply)
            return results
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
    got = run_example(example)
    wrong = {m: (expected[m], got[m]) for m in MAGICS if not agrees(expected[m], got[m])}
    assert not wrong, wrong


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
        results = run_example(example)
        print(f"| `{example}` | " + " | ".join(short(results[m]) for m in MAGICS) + " |", flush=True)
