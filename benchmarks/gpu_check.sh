#!/usr/bin/env bash
# One command for a CUDA machine (torch, cupy, pytest; hydra-core and lightning not needed): the GPU
# kernel tests, the CPU kernel tests and the CUDA source checks, the engine's GPU tests (when Lightning
# imports), then the kernel benchmark, importing
# zero_strategy from this working tree. Results go to $OUT when it is set (environment, pytest log,
# JUnit XML, benchmark log and JSON), else to benchmarks/results_gpu/.
#   bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results_gpu}"
mkdir -p "$out"
export OUT="$out"

# Python with `zero_strategy` registered as a bare package, so its __init__ (Lightning, Hydra) does
# not run: zero_strategy.kernels needs torch (and CuPy) only. Then runs a module or a script.
bare() {
  python - "$@" <<'PY'
import os, runpy, sys, types
package = types.ModuleType("zero_strategy")
package.__path__ = [os.path.abspath("zero_strategy")]
sys.modules["zero_strategy"] = package
sys.argv = sys.argv[1:]
if sys.argv[0].endswith(".py"):
    runpy.run_path(sys.argv[0], run_name="__main__")
else:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
PY
}

python -c "import torch, cupy; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| cupy', cupy.__version__, '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" 2>&1 | tee "$out/environment.txt"
bare pytest -p no:cacheprovider -o addopts="" -q -rs --junitxml="$out/kernel_tests.xml" \
    tests/test_kernels_gpu.py tests/test_kernels.py tests/test_cuda_sources.py 2>&1 | tee "$out/kernel_tests.log"
tests=${PIPESTATUS[0]}
# The engine on the GPU (needs Lightning, which the package's __init__ imports; not Hydra)
if python -c "import lightning" 2>/dev/null; then
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python -m pytest -p no:cacheprovider -o addopts="" -q -rs \
      --junitxml="$out/engine_tests.xml" tests/test_engine_gpu.py tests/test_activation_checkpointing.py -k "gpu or cuda" \
      2>&1 | tee "$out/engine_tests.log"
  engine=${PIPESTATUS[0]}
  tests=$(( tests != 0 ? tests : engine ))
fi
bare benchmarks/bench_kernels.py --out "$out/bench_kernels.json" 2>&1 | tee "$out/bench_kernels.log"
bench=${PIPESTATUS[0]}
echo "gpu_check: tests exit $tests, benchmark exit $bench; results in $out"
exit $(( tests != 0 ? tests : bench ))
