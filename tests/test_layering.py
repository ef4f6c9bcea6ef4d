"""The package layering: every package sits on one floor, and imports point down only.

A module imports from its own package or the packages below it, never from one above, and no two files import each
other, directly or around a longer circle. Every ``import zaya...`` / ``from zaya... import`` statement counts,
including those inside functions (an import made lazily to dodge a cycle is still a cycle in the design).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "zaya"
FLOORS = ["core", "config", "model", "optim", "data", "distributed", "checkpoint", "serve", "eval", "train", "tune",
          "aegis", "cli"]
"""From the ground floor up. ``zaya/__init__.py`` (``zaya.load_pretrained``) and ``__main__`` sit with the cli."""
RANK = {name: i for i, name in enumerate(FLOORS)}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floor_of(module: str) -> str:
    """'zaya.model.moe' -> 'model'; 'zaya', 'zaya.__main__' -> 'cli'."""
    parts = module.split(".")
    return "cli" if len(parts) == 1 or parts[1] == "__main__" else parts[1]


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def zaya_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import of a zaya module in ``path``; ``from zaya.x import y`` names ``zaya.x.y``
    where ``y`` is a module, else ``zaya.x``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "zaya"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "zaya":
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES]
            found += [(node.lineno, m) for m in subs] or [(node.lineno, node.module)]
    return found


def test_every_module_has_a_floor():
    for name in MODULES:
        assert floor_of(name) in RANK, f"{name} is on no floor: add its package to FLOORS in {__file__}"


def test_no_module_imports_from_a_floor_above_its_own():
    upward = []
    for name, path in MODULES.items():
        mine = floor_of(name)
        for line, target in zaya_imports(path):
            if target != "zaya" and RANK[floor_of(target)] > RANK[mine]:
                upward.append(f"{path.relative_to(SRC.parent)}:{line} ({mine}) imports {target}")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_circle_between_files():
    """Depth-first search over file -> file imports; a back edge is a circle (printed as its files in order)."""
    graph = {name: sorted({t for _, t in zaya_imports(path) if t in MODULES and t != name})
             for name, path in MODULES.items()}
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    circles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                circles.append(" -> ".join(path[path.index(nxt):] + [node, nxt]) if nxt in path else f"{node}->{nxt}")
            elif nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [])
    assert not circles, "files that import each other:\n" + "\n".join(circles)


def test_the_checker_finds_what_it_is_for(tmp_path):
    """The checks above, on a made-up import, would fail: the floor order and the module map are what they say."""
    assert RANK[floor_of("zaya.model.moe")] < RANK[floor_of("zaya.serve.engine")]
    assert floor_of("zaya") == floor_of("zaya.__main__") == "cli"
    bad = tmp_path / "x.py"
    bad.write_text("def f():\n    from zaya.serve.engine import Engine\nfrom zaya.core import fsutil\n")
    assert zaya_imports(bad) == [(3, "zaya.core.fsutil"), (2, "zaya.serve.engine")] or \
        sorted(zaya_imports(bad)) == [(2, "zaya.serve.engine"), (3, "zaya.core.fsutil")]
