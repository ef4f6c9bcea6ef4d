"""The package layering: a module imports only from its own layer or the layers below it, never upward.

    (errors, device, fsutil, procs, tune.profile) -> config -> serve engine -> model -> optim -> data -> dist
    -> checkpoint -> eval -> train -> tune -> aegis -> serve (HTTP) -> cli

The serving package spans two layers: its engine modules (sampling, request, text, engine) drive a model only
through the object they are given, so they sit below the model, which runs ``generate`` on them; its HTTP side
(``zaya serve``: loading a checkpoint, the tokenizer, FastAPI) sits above everything but the cli. The tuning package
spans two too: the hardware profile (``tune.profile``) is read by the model, the optimizer and the parallel wrappers,
so it sits at the bottom; the tune and plan commands, which drive all of those, sit above the trainer.

Every ``import zaya...`` / ``from zaya... import`` statement counts, including those inside functions (imported
lazily or not, an upward import is a cycle in the design). The top-level package (``zaya.load_pretrained``) and
``zaya.__main__`` sit with the cli.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "zaya"
SERVE_ENGINE = ("serve.sampling", "serve.request", "serve.text", "serve.engine")
HARDWARE_PROFILE = "tune.profile"
SPLIT = (*SERVE_ENGINE, HARDWARE_PROFILE)
LAYERS = [("errors", "device", "fsutil", "procs", HARDWARE_PROFILE), ("config",), SERVE_ENGINE, ("model",), ("optim",),
          ("data",), ("dist",), ("checkpoint",), ("eval",), ("train",), ("tune",), ("aegis",), ("serve",),
          ("cli", "__init__", "__main__")]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def layer_of(module: str) -> str:
    """'zaya.model.moe' -> 'model'; 'zaya' -> '__init__'; 'zaya.serve.engine' -> 'serve.engine' (an engine
    module), 'zaya.serve.server' -> 'serve'."""
    parts = module.split(".")
    if len(parts) > 2 and ".".join(parts[1:3]) in SPLIT:
        return ".".join(parts[1:3])
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


def test_the_serving_engine_imports_no_model_code():
    """The engine sits below the model (model.generate runs on it): it must reach the model only through the object
    it is given, and must not pull in the web stack."""
    for name in SERVE_ENGINE:
        path = SRC / (name.replace(".", "/") + ".py")
        for _, target in zaya_imports(path):
            assert layer_of(target) in SERVE_ENGINE or RANK[layer_of(target)] < RANK["model"], (path, target)
        assert "fastapi" not in path.read_text(), path
