"""The package layering: a module imports only from its own layer or the layers below it, never upward.

    (errors, device, fsutil) -> config -> model -> optim -> data -> dist -> checkpoint -> eval -> train -> aegis -> cli

Every ``import zaya...`` / ``from zaya... import`` statement counts, including those inside functions (imported
lazily or not, an upward import is a cycle in the design). The top-level package (``zaya.load_pretrained``) and
``zaya.__main__`` sit with the cli.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "zaya"
LAYERS = [("errors", "device", "fsutil"), ("config",), ("model",), ("optim",), ("data",), ("dist",),
          ("checkpoint",), ("eval",), ("train",), ("aegis",), ("cli", "__init__", "__main__")]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def layer_of(module: str) -> str:
    """'zaya.model.moe' -> 'model'; 'zaya' -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def zaya_imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "zaya"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "zaya":
            found.append((node.lineno, node.module))
            if node.module == "zaya":  # from zaya import errors: judged by the module imported
                found += [(node.lineno, f"zaya.{a.name}") for a in node.names
                          if (SRC / a.name).is_dir() or (SRC / f"{a.name}.py").is_file()]
    return found


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    return ".".join(rel.parts)


def test_every_module_has_a_layer():
    for path in SRC.rglob("*.py"):
        name = module_name(path)
        assert layer_of(name) in RANK, f"{name} is in no layer: add its package to LAYERS in {__file__}"


def test_no_module_imports_from_a_layer_above_its_own():
    upward = []
    for path in sorted(SRC.rglob("*.py")):
        mine = layer_of(module_name(path))
        for line, target in zaya_imports(path):
            theirs = layer_of(target)
            if theirs == "__init__" and target == "zaya":
                continue  # "from zaya import x" is judged by x (added separately)
            if RANK[theirs] > RANK[mine]:
                upward.append(f"{path.relative_to(SRC.parent)}:{line} ({mine}) imports {target} ({theirs})")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_the_model_never_imports_the_checkpoint_package():
    for path in (SRC / "model").rglob("*.py"):
        assert not [t for _, t in zaya_imports(path) if t.startswith("zaya.checkpoint")], path
