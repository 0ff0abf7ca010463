"""Every cuda/*.cu compiles with nvcc for the GPUs we target (sm_80, sm_90). Skips without nvcc."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SOURCES = sorted((Path(__file__).parent.parent / "cuda").glob("*.cu"))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", SOURCES, ids=[s.name for s in SOURCES])
def test_compiles(source, arch, tmp_path):
    out = tmp_path / f"{source.stem}.o"
    proc = subprocess.run(["nvcc", f"-arch={arch}", "-std=c++17", "-c", str(source), "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 0
