"""The import graph of dsckpt/ points one way: no module reaches back, directly or through others, to a module
that imports it -- top-level, deferred (inside functions) and ``TYPE_CHECKING`` imports alike -- and the logical
model (model.py) imports nothing parallel at run time (STYLE.md, "General below specific")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dsckpt"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imported(module: str, tree: ast.AST, *, skip_type_checking: bool = False) -> set[str]:
    """The dsckpt modules ``module`` imports. ``from . import x`` names the module ``x`` when there is one (that
    import runs the package's ``__init__`` first, which every submodule import does anyway)."""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    skipped: set[int] = set()
    if skip_type_checking:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
            names = subs if len(subs) == len(node.names) else [target, *subs]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out.update(n for n in names if n in MODULES and n != module)
    return out


def _graph(**kw: bool) -> dict[str, set[str]]:
    return {m: _imported(m, ast.parse(p.read_text()), **kw) for m, p in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles (top-level, deferred and TYPE_CHECKING imports): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_the_cycle_finder_sees_deferred_and_type_checking_imports() -> None:
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .parallel_layout import X\n"
                     "def f():\n    from .readers import FileCache\n    from . import crc\n")
    assert _imported("dsckpt.model", tree) == {"dsckpt.parallel_layout", "dsckpt.readers", "dsckpt.crc"}
    assert _imported("dsckpt.model", tree, skip_type_checking=True) == {"dsckpt.readers", "dsckpt.crc"}
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


@pytest.mark.parametrize("module", ["dsckpt.model", "dsckpt.parallel_layout"], ids=str)
def test_general_modules_import_nothing_specific_at_run_time(module: str) -> None:
    """The logical model depends on nothing parallel; the general description of layouts and cuts depends on no
    record that produces cuts (AutoTP / Megatron-style, MoE, readers, writers)."""
    allowed = {"dsckpt.model": {"dsckpt.errors", "dsckpt.binding", "dsckpt.optimizer_group"},
               "dsckpt.parallel_layout": {"dsckpt.errors"}}
    imported = _imported(module, ast.parse(MODULES[module].read_text()), skip_type_checking=True)
    assert imported <= allowed[module], f"{module} imports {sorted(imported - allowed[module])} at run time"
