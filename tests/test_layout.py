"""The shape of the code, checked: no import circle between the files of the three crates, and
the kernel's layers (kernel → engine → cells → session, the pure rooms below them) import only
downwards. Reads the sources; no build needed."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CRATES = {"kernel": ROOT / "src", "runtime": ROOT / "runtime" / "src", "wire": ROOT / "wire" / "src",
          "show": ROOT / "show" / "src"}

# A path that starts at the crate root or the parent module, with an optional `{…}` group.
PATH = re.compile(r"\b(crate|super)((?:::\w+)*)(?:::\{([^{}]*)\})?")


def modules(src: Path) -> dict:
    """Module path (tuple of names) -> file, for every file of a crate."""
    found = {}
    for file in src.rglob("*.rs"):
        parts = list(file.relative_to(src).with_suffix("").parts)
        if parts[-1] in ("mod", "lib", "main"):
            parts = parts[:-1]
        found[tuple(parts)] = file
    return found


def strip_comments(text: str) -> str:
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


def resolve(mods: dict, path: tuple) -> tuple:
    """The longest prefix of `path` that is a module of the crate."""
    for end in range(len(path), -1, -1):
        if path[:end] in mods:
            return path[:end]
    return ()


def edges(src: Path) -> dict:
    """File module -> the modules it refers to (an ancestor's items are not counted: a child
    module naming its parent's items is how Rust modules are written)."""
    mods = modules(src)
    out = {}
    for here, file in mods.items():
        text = strip_comments(file.read_text())
        # The parent of a `mod.rs`/leaf file: super:: from `a/b.rs` is `a`.
        parent = here[:-1]
        targets = set()
        for root, rest, group in PATH.findall(text):
            base = () if root == "crate" else parent
            prefix = base + tuple(p for p in rest.split("::") if p)
            items = [g.strip() for g in group.split(",")] if group else [""]
            for item in items:
                item = re.split(r"\s+as\s+", item)[0]
                names = tuple(p for p in item.split("::") if p)
                if names and names[0] in ("self",):
                    names = ()
                target = resolve(mods, prefix + names)
                if target != here and here[: len(target)] != target:
                    targets.add(target)
        out[here] = targets
    return out


def circles(graph: dict) -> list:
    """Every strongly connected group of more than one module."""
    index, low, stack, on, groups = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                groups.append(sorted("::".join(m) or "<root>" for m in group))

    for node in graph:
        if node not in index:
            visit(node)
    return groups


@pytest.mark.parametrize("crate", sorted(CRATES))
def test_no_import_circle_between_files(crate):
    assert circles(edges(CRATES[crate])) == []


# What each room of the kernel crate must never import (the layers read top to bottom).
NEVER = {
    "session": {"cells", "engine", "kernel", "notebook", "cli", "magics", "rewrite", "fit",
                "report", "timeline"},
    "cells": {"engine", "kernel", "notebook", "cli"},
    "engine": {"kernel", "notebook", "cli"},
    "magics": {"cells", "session", "engine", "kernel", "child"},
    "rewrite": {"cells", "session", "engine", "kernel", "child"},
    "fit": {"cells", "session", "engine", "kernel", "child"},
    "timeline": {"cells", "session", "engine", "kernel", "child"},
    "report": {"cells", "session", "engine", "kernel", "child"},
}


def test_the_kernel_crate_imports_only_downwards():
    graph = edges(CRATES["kernel"])
    wrong = sorted(
        f"{'::'.join(here)} -> {'::'.join(target)}"
        for here, targets in graph.items()
        if here and here[0] in NEVER
        for target in targets
        if target and target[0] in NEVER[here[0]]
    )
    assert wrong == []


def test_the_checker_sees_a_circle_and_an_upward_import(tmp_path):
    # The checks above must be able to fail.
    (tmp_path / "a.rs").write_text("use crate::b::thing;\n")
    (tmp_path / "b.rs").write_text("use super::a::other; // a comment: crate::c\n")
    (tmp_path / "main.rs").write_text("mod a;\nmod b;\n")
    assert circles(edges(tmp_path)) == [["a", "b"]]
    graph = edges(CRATES["kernel"])
    assert ("session",) in graph[("cells",)]


def test_the_crate_every_cell_imports_depends_on_nothing():
    """rustc loads, and links into a cell's library, every crate the cell imports: the prelude's
    one import (`tchmem-show`) must stay free of dependencies, or every cell pays for them (the
    runtime's cost a cell that names nothing of tch ~0.1 s, results/vs-evcxr-cpu.txt)."""
    import tomllib

    manifest = tomllib.loads((ROOT / "show" / "Cargo.toml").read_text())
    assert not manifest.get("dependencies") and "build-dependencies" not in manifest
    prelude = (ROOT / "src" / "session" / "context.rs").read_text()
    imports = re.findall(r"\buse (\w+)::[\w:]+ as _;", prelude)
    assert imports == ["tchmem_show"], imports
