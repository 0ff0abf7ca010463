"""Packaging: the configs reach a non-editable install (conf/ is mapped into the wheel as
zero_strategy/conf, see the note in pyproject.toml, and the package finds it there); the package
imports Lightning only when asked for it (see [Note: a lazy package face] in zero_strategy/__init__.py);
the library needs only the core dependencies, the Hydra app also its [app] extra."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_on_disk_is_listed_in_pyproject():
    # the list is explicit because setuptools' find cannot see the mapped conf/ folder; a package
    # missing from it would work in a checkout and be absent from the wheel
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "zero_strategy").rglob("__init__.py")}
    assert on_disk | {"zero_strategy.conf"} == listed


@pytest.mark.timeout(240)
def test_wheel_carries_the_configs_and_finds_them(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("zero_strategy", "conf"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist")], check=True, capture_output=True, timeout=200)
    wheel = next((tmp_path / "dist").glob("zero_strategy-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    yamls = {f"zero_strategy/conf/{p.relative_to(ROOT / 'conf').as_posix()}" for p in (ROOT / "conf").rglob("*.yaml")}
    assert yamls and yamls <= names
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "zero-train = zero_strategy.cli:train" in entry_points
    assert "zero-estimate = zero_strategy.cli:estimate" in entry_points

    # installed as a plain wheel would be (unpacked onto the path, no checkout next to it)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = "from zero_strategy.cli.configs import config_dir; print(config_dir())"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout.strip()
    assert Path(out) == site / "zero_strategy" / "conf"
    est = subprocess.run([sys.executable, "-m", "zero_strategy.cli.estimate", "world_size=4"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert est.returncode == 0 and "842,496 parameters, 4 ranks" in est.stdout, est.stderr


# ---- the library / app boundary: lazy imports and the [app] extra ----------------------------

APP_FOLDERS = ("cli", "models", "data")  # the Hydra application's code: see [Note: the app extra] in pyproject.toml
HEAVY = ("lightning", "pytorch_lightning", "hydra", "omegaconf", "rich")

# Each runs in a fresh interpreter (what is imported is the point) and prints one JSON line.
_TRAINER = """
import json, lightning as L
def made(name):
    strategy = L.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False).strategy
    config = strategy.config
    return [type(strategy).__name__, config.stage, config.offload_optimizer, config.offload_params]
"""
_SCRIPTS = {
    # a bare import loads none of Lightning, Hydra or rich; a Trainer made afterwards finds the names
    "bare import, then a Trainer": """
import sys, zero_strategy
from zero_strategy import ZeroConfig, ZeroOptimizer, estimate_memory
import zero_strategy.engine, zero_strategy.kernels
loaded = sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))
""" + _TRAINER + """
names = ("zero_stage_3", "zero_stage_2_offload", "zero_stage_3_offload")
print(json.dumps({"loaded": loaded, "made": {name: made(name) for name in names}}))
""",
    # Lightning first: the names are registered at once
    "Lightning first": """
import lightning, zero_strategy
""" + _TRAINER + """
print(json.dumps({"made": {"zero_stage_1": made("zero_stage_1")}}))
""",
    # ZeroStrategy named first (Lightning loads inside zero_strategy.strategy's import), in an
    # interpreter where Hydra and rich are not installed: the library, a Trainer and a step of the
    # engine work without them
    "ZeroStrategy first, without the app's packages": """
import importlib.util
missing = [m for m in APP_ONLY if importlib.util.find_spec(m) is None]
from zero_strategy import ZeroStrategy
""" + _TRAINER + """
import torch
from zero_strategy import ZeroConfig, ZeroOptimizer
model = torch.nn.Linear(4, 3)
opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), ZeroConfig(stage=2))
before = model.weight.detach().clone()
model(torch.randn(2, 4)).sum().backward()
opt.step()
print(json.dumps({"missing": missing, "made": {"zero_stage_2": made("zero_stage_2")},
                  "stepped": not torch.equal(before, model.weight)}))
""",
}


APP_ONLY = {"hydra": "hydra_core", "omegaconf": "omegaconf", "rich": "rich"}  # module: its distribution's folder prefix


def _site_packages_without(hidden: dict[str, str], folder: Path) -> Path:
    """A view of this interpreter's site-packages (a link to every entry) without the ``hidden``
    modules and their distributions' metadata: with ``python -S`` and it on the path, they are not
    installed."""
    site = Path(sysconfig.get_paths()["purelib"])
    folder.mkdir()
    for entry in site.iterdir():
        if entry.name in hidden or any(entry.name.startswith(f"{dist}-") for dist in hidden.values()):
            continue
        (folder / entry.name).symlink_to(entry)
    return folder


@pytest.mark.timeout(240)
def test_the_package_imports_lightning_only_when_asked_and_registers_its_names_in_any_order(tmp_path):
    without_app = _site_packages_without(APP_ONLY, tmp_path / "site")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    procs = {}
    for what, code in _SCRIPTS.items():  # concurrently: each spends its time importing Lightning
        command, run_env = [sys.executable, "-c", f"HEAVY = {HEAVY!r}\nAPP_ONLY = {list(APP_ONLY)!r}\n{code}"], env
        if "without the app" in what:
            command, run_env = [sys.executable, "-S", *command[1:]], {**env, "PYTHONPATH": f"{ROOT}:{without_app}"}
        procs[what] = subprocess.Popen(command, cwd=ROOT, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True)
    out = {}
    for what, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=200)
        assert proc.returncode == 0, f"{what}:\n{stderr[-4000:]}"
        out[what] = json.loads(stdout.strip().splitlines()[-1])
    bare = out["bare import, then a Trainer"]
    assert bare["loaded"] == []
    assert bare["made"] == {"zero_stage_3": ["ZeroStrategy", 3, False, False],
                            "zero_stage_2_offload": ["ZeroStrategy", 2, True, False],
                            "zero_stage_3_offload": ["ZeroStrategy", 3, True, True]}
    assert out["Lightning first"]["made"] == {"zero_stage_1": ["ZeroStrategy", 1, False, False]}
    assert out["ZeroStrategy first, without the app's packages"] == {
        "missing": list(APP_ONLY), "made": {"zero_stage_2": ["ZeroStrategy", 2, False, False]}, "stepped": True}


def _distribution(requirement: str) -> str:
    """The normalised distribution name of a requirement string ("hydra-core>=1.3" -> "hydra-core")."""
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-").replace(".", "-")


def _with_requirements(names: set[str]) -> set[str]:
    """``names`` and every distribution they require, as installed (extras and markers left out)."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [_distribution(r) for r in requires if "extra ==" not in r]
    return seen


def _module_level_imports(path: Path) -> set[str]:
    """Top-level names of the third-party modules ``path`` imports when it is imported (not those
    imported inside functions, which are optional or app-only by design)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        for n in node.body if isinstance(node, ast.Try) else [node]:
            if isinstance(n, ast.Import):
                names |= {a.name.split(".")[0] for a in n.names}
            elif isinstance(n, ast.ImportFrom) and n.level == 0:
                names.add(n.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"zero_strategy"}


def test_the_library_needs_only_the_core_dependencies_and_the_app_its_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert "zero-strategy[app]" in extras["test"], "the README's `pip install -e \".[test]\" && zero-train` needs [app]"
    core = {_distribution(r) for r in project["dependencies"]}
    app = {_distribution(r) for r in extras["app"]}
    allowed = {"library": _with_requirements(core - app), "app": _with_requirements(core | app)}
    provider = {module: {_distribution(d) for d in dists}
                for module, dists in importlib.metadata.packages_distributions().items()}
    wrong = []
    for path in sorted((ROOT / "zero_strategy").rglob("*.py")):
        part = "app" if path.relative_to(ROOT / "zero_strategy").parts[0] in APP_FOLDERS else "library"
        for module in sorted(_module_level_imports(path)):
            if not provider.get(module, {module}) & allowed[part]:
                wrong.append(f"{path.relative_to(ROOT)} imports {module} ({part})")
    assert not wrong, "imports that the install would not provide: " + "; ".join(wrong)
