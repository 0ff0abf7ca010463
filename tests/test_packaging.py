"""The configs reach a non-editable install: conf/ is mapped into the wheel as zero_strategy/conf
(see the note in pyproject.toml), and the package finds it there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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
    assert "zero-train = zero_strategy.cli.train:main" in entry_points
    assert "zero-estimate = zero_strategy.cli.estimate:main" in entry_points

    # installed as a plain wheel would be (unpacked onto the path, no checkout next to it)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = "from zero_strategy.cli import config_dir; print(config_dir())"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout.strip()
    assert Path(out) == site / "zero_strategy" / "conf"
    est = subprocess.run([sys.executable, "-m", "zero_strategy.cli.estimate", "world_size=4"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert est.returncode == 0 and "842,496 parameters, 4 ranks" in est.stdout, est.stderr
