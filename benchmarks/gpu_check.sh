#!/usr/bin/env bash
# One command for a CUDA machine (torch, cupy, pytest; hydra-core not needed): the GPU kernel tests,
# the CPU kernel tests, and the kernel benchmark, importing zero_strategy from this working tree.
# Results go to $OUT when it is set (pytest log, JUnit XML, benchmark JSON and log), else benchmarks/results_gpu/.
#   bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results_gpu}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OUT="$out"
python -c "import torch, cupy; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| cupy', cupy.__version__, '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" 2>&1 | tee "$out/environment.txt"
python -m pytest -p no:cacheprovider -o addopts="" -q -rs --junitxml="$out/kernel_tests.xml" \
    tests/test_kernels_gpu.py tests/test_kernels.py tests/test_cuda_sources.py 2>&1 | tee "$out/kernel_tests.log"
tests=${PIPESTATUS[0]}
python benchmarks/bench_kernels.py --out "$out/bench_kernels.json" 2>&1 | tee "$out/bench_kernels.log"
bench=${PIPESTATUS[0]}
echo "gpu_check: tests exit $tests, benchmark exit $bench; results in $out"
exit $(( tests != 0 ? tests : bench ))
