"""Imports point one way: server -> chat/engine -> model/gpu -> io, and no module circles.

Read from the source (lazy imports inside functions count too), so a new wrong-way arrow
fails here rather than surfacing as an import cycle at run time.
"""

import ast
from collections import defaultdict
from pathlib import Path

import q27py

ROOT = Path(q27py.__file__).resolve().parent

# May import from: (each package also imports itself and the shared base modules).
ALLOWED = {
    "io": set(),
    "tokenizer": set(),
    "model": {"io"},
    "gpu": {"io", "model"},
    "chat": {"tokenizer"},
    "engine": {"model", "gpu", "io", "tokenizer"},
    "server": {"chat", "engine", "tokenizer"},
}
BASE = {"errors", "config", "__init__"}
# The one known wrong-way arrow: io/q27file.py reads model.config (its tier tables name the
# model's layers). Its gpu.layout import is gone (the packer moved to gpu/q27pack.py). Listed by
# name, so any other io -> model/gpu import still fails.
KNOWN = {("q27py.io.q27file", "q27py.model.config")}


def _imports():
    graph = defaultdict(set)
    for path in ROOT.rglob("*.py"):
        mod = "q27py." + ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("q27py"):
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                graph[mod].update(n for n in names if _exists(n))
            elif isinstance(node, ast.Import):
                graph[mod].update(a.name for a in node.names if a.name.startswith("q27py"))
    return graph


def _exists(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists()


def _package(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_packages_import_one_way():
    wrong = []
    for mod, targets in _imports().items():
        src = _package(mod)
        if src not in ALLOWED:
            continue  # commands/, bench/, cli: the top, may use anything
        for target in targets:
            dst = _package(target)
            if dst in (src, *BASE) or dst in ALLOWED[src] or (mod, target) in KNOWN:
                continue
            wrong.append(f"{mod} -> {target}")
    assert not wrong, "wrong-way imports:\n" + "\n".join(sorted(wrong))


def test_no_module_import_cycles():
    graph = _imports()
    state: dict[str, int] = {}
    cycles = []

    def visit(mod, stack):
        state[mod] = 1
        stack.append(mod)
        for nxt in sorted(graph.get(mod, ())):
            if nxt.endswith("__init__") or nxt == "q27py" or nxt.count(".") == 1 and (ROOT / nxt.split(".")[1] / "__init__.py").exists():
                continue  # package __init__ files are empty re-export points
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_file_path_imports():
    offenders = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
                 if "spec_from_file_location" in p.read_text(encoding="utf-8")]
    assert not offenders


def test_test_module_basenames_are_unique():
    """pytest imports test files by basename (no packages under tests/): two test_x.py in different
    folders stop the whole collection (CI on 2026-12-01: tests/gpu and tests/model test_decode_batch.py)."""
    from collections import Counter

    root = Path(__file__).resolve().parent
    names = Counter(p.name for p in root.rglob("test_*.py"))
    assert not [n for n, c in names.items() if c > 1]
