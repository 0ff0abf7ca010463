"""The package's shape: imports run one way, and every named note that a comment cites exists.

[Note: the engine's layers]
``zero_strategy/engine/`` is cut by concept into sub-packages, each importing only those below it:

    diagnose  <-  comm  <-  buffers  <-  params, grads  <-  optim  <-  join (and the engine's __init__)

diagnose: what the engine knows when ranks part (header, rank board, tally, watchdog); comm: every
byte sent (collectives, volume, quantization, hybrid topology, the order guard on gathers); buffers:
flat buffers and their memory; params: stage 3's units, the owner of the flat groups, what the engine
attaches to modules and the broadcast of their buffers; grads: the reducer, accumulation, the loss
scaler; optim: ZeroOptimizer, its state and checks, and one file per step backend in optim/step/. params and grads do not import each other. Outside the engine the
package runs config <- engine <- frontend <- strategy, fabric, deepspeed <- cli, and the engine
never imports Lightning or Hydra. Every import counts, type-only and function-level ones too: an
import circle, even a type-only one, makes two modules one unit to read and to change.

The check reads the source (``ast``), so it needs no process group and imports nothing.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "zero_strategy"
ROOT = PACKAGE.parent
ENGINE_LAYERS = {"diagnose": 0, "comm": 1, "buffers": 2, "params": 3, "grads": 3, "optim": 4, "join": 5}
"""Each engine sub-package (or module) and its layer: it may import from lower layers only."""
NOT_IN_ENGINE = ("lightning", "pytorch_lightning", "hydra", "omegaconf")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module of the package, and every outside top-level package, that ``name`` imports."""
    found: set[str] = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                if node.level else node.module or ""
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            found.add(target)
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _engine_layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["zero_strategy", "engine"] or len(parts) < 3:
        return None
    return ENGINE_LAYERS[parts[2]]


def test_no_import_circles():
    assert _cycles(_graph()) == []


def test_engine_imports_run_down_the_layers():
    against = []
    for module, imported in _graph().items():
        mine = _engine_layer(module)
        if mine is None:
            continue
        for target in sorted(imported):
            theirs = _engine_layer(target)
            if target.split(".")[0] in NOT_IN_ENGINE:
                against.append(f"{module} imports {target}: the engine is plain torch")
            elif target.startswith("zero_strategy.") and not target.startswith("zero_strategy.engine") \
                    and target.split(".")[1] not in ("config", "kernels"):
                against.append(f"{module} imports {target}, which is above the engine")
            elif theirs is not None and (theirs > mine or (theirs == mine and target.split(".")[2] != module.split(".")[2])):
                against.append(f"{module} (layer {mine}) imports {target} (layer {theirs})")
    assert against == [], "see [Note: the engine's layers]:\n" + "\n".join(against)


def test_every_engine_module_has_a_layer():
    unplaced = [m for m in _modules() if m.startswith("zero_strategy.engine.") and m.split(".")[2] not in ENGINE_LAYERS]
    assert unplaced == [], f"add these to ENGINE_LAYERS or move them into a sub-package: {unplaced}"


# ---- named notes ----------------------------------------------------------------------------------

_DEFINITION = re.compile(r"^\s*(?:#|//)?\s*(?:[\"']{3})?\[Note: ([^\]]+)\](?:\s*$|\s+\(the plan|"
                         r"\s+(?!in |of |and |or |for |says|is |above|below|tells|marks)[a-z])")
_CITATION = re.compile(r"\[Note:\s+([^\]]+)\],?\s+(?:in|of)\s+((?:\.\./)?[\w/]+\.(?:py|toml|cuh|cu))\b")
_SOURCES = ("zero_strategy", "tests", "benchmarks", "cuda")


def _note_files() -> list[Path]:
    files = [p for d in _SOURCES for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".cu", ".cuh")]
    return files + [ROOT / "pyproject.toml"]


def _definitions(files: list[Path]) -> dict[str, list[Path]]:
    defined: dict[str, list[Path]] = defaultdict(list)
    for path in files:
        for line in path.read_text().splitlines():
            match = _DEFINITION.match(line)
            if match:
                defined[match.group(1)].append(path)
    return defined


def test_each_note_is_defined_once():
    twice = {name: [str(p.relative_to(ROOT)) for p in paths]
             for name, paths in _definitions(_note_files()).items() if len(set(paths)) > 1}
    assert twice == {}


def test_cited_notes_are_where_the_citation_says():
    """``[Note: X] in path``: path (from the repository root, from zero_strategy/, or from the citing file's
    folder) defines X."""
    files = _note_files()
    defined = _definitions(files)
    wrong = []
    for path in files:
        for match in _CITATION.finditer(path.read_text()):
            name = " ".join(match.group(1).replace("#", " ").split())
            cited = match.group(2)
            places = defined.get(name)
            if not places:
                wrong.append(f"{path.relative_to(ROOT)}: [Note: {name}] is defined nowhere")
            elif not any((ROOT / cited, PACKAGE / cited, path.parent / cited)[i].resolve() == p.resolve()
                         for p in places for i in range(3)):
                wrong.append(f"{path.relative_to(ROOT)}: [Note: {name}] is in {places[0].relative_to(ROOT)}, not {cited}")
    assert wrong == [], "\n".join(wrong)
