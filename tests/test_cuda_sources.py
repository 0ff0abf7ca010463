"""Every cuda/*.cu compiles for the GPUs we target (sm_80, sm_90): with nvcc (skips without it; device code
only, see test_compiles), and with NVRTC as the loader hands it over (skips without CuPy and libnvrtc);
compiler errors name the .cu file."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SOURCES = sorted((Path(__file__).parent.parent / "cuda").glob("*.cu"))


ARCHS = ("80", "90")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("source", SOURCES, ids=[s.name for s in SOURCES])
def test_compiles(source, tmp_path):
    # device code only, as NVRTC compiles it at run time (the host side never is): a cubin for the newer
    # architecture (the front end, then ptxas: register and resource limits) and PTX for the older (the
    # front end alone, which is where arch-conditional source differs); ptxas is most of nvcc's time
    newest, *older = sorted(ARCHS, reverse=True)
    runs = {tmp_path / f"{source.stem}.cubin": [f"-arch=sm_{newest}", "-cubin"],
            **{tmp_path / f"{source.stem}_{a}.ptx": [f"-arch=compute_{a}", "-ptx"] for a in older}}
    for out, flags in runs.items():
        proc = subprocess.run(["nvcc", *flags, "-std=c++17", str(source), "-o", str(out)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert out.stat().st_size > 0


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
        return nvrtc
    except Exception:  # CuPy or libnvrtc missing
        return None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_compiler_errors_name_the_cu_file_and_line(tmp_path):
    # the loader hands NVRTC the text behind `#line 1 "<path>"`; any compiler then blames <path>:<line>
    from zero_strategy.kernels.loader import compile_options, with_line_directive

    original = tmp_path / "broken_kernel.cu"
    original.write_text('#include "zs_common.cuh"\n\n__global__ void k(float* x) { x[0] = undefined_name; }\n')
    prepared = tmp_path / "prepared.cu"
    prepared.write_text(with_line_directive(original.read_text(), original))
    include = [o for o in compile_options() if o.startswith("-I")]
    proc = subprocess.run(["nvcc", "-arch=sm_80", "-std=c++17", *include, "-c", str(prepared), "-o", str(tmp_path / "p.o")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert f"{original}(3)" in proc.stderr and "undefined_name" in proc.stderr, proc.stderr


@pytest.mark.skipif(_nvrtc() is None, reason="CuPy with libnvrtc is not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvrtc_compiles_every_kernel_the_loader_names(arch):
    # what CuPy does at run time (same text, options and name expressions), without a GPU
    from zero_strategy.kernels.loader import KERNELS, compile_options, read_source

    nvrtc = _nvrtc()
    for stem, names in KERNELS.items():
        prog = nvrtc.createProgram(read_source(stem), f"{stem}.cu", [], [])
        for name in names:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, [*compile_options(), f"-arch={arch}"])
        except Exception as e:
            pytest.fail(f"{stem}.cu: {e}\n{nvrtc.getProgramLog(prog)}")
        assert all(nvrtc.getLoweredName(prog, name) for name in names)
