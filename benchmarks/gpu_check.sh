#!/usr/bin/env bash
# Every GPU test and GPU benchmark of this repository in one command, for a CUDA machine, in a time
# budget, importing zero_strategy from this working tree (nothing to install: `import zero_strategy`
# loads no Lightning or Hydra, see [Note: a lazy package face] in zero_strategy/__init__.py). Needs
# torch with CUDA, CuPy, pytest, pytest-timeout, safetensors and xxhash; Lightning for the one
# activation test and the stages benchmark.
#   bash benchmarks/gpu_check.sh                     # BUDGET_S=390, PYTHON=python3 by default
# Results go to $OUT when it is set, else to benchmarks/results_gpu/, twelve files: summary.txt (the
# environment, then each step's exit status and seconds), kernel_tests.log, engine_tests.log,
# bench_gpt2.log and .json, bench_kernels.log and .json, bench_fused_step.log and .json, bench_activations.log,
# bench_offload.log, bench_stages.log.
#
# [Note: the GPU check's time budget]
# A GPU machine is lent for 15 minutes in all, its start and the transfers included, so this script
# must end well inside 8: BUDGET_S (390 s) caps it. Steps run in the order of what they prove: the
# kernels against their torch references, the engine on one GPU and at world size 2 on it (two
# processes on cuda:0 over gloo, tests/test_engine_gpu_multirank.py), then the benchmarks: the
# kernels, the optimizer phase of a 1B-parameter stage-2 model through the engine against torch's
# AdamW(fused=True) path (bench_fused_step.py: about 34 GB of device memory, 20-30 s expected with
# the kernels already compiled by the tests), then the rest at small sizes. Each step runs under
# `timeout` for the smaller of its own cap and what is left of the budget; a step that would start
# with under MIN_STEP_S left is skipped, says so, and fails the run.
# Expected on an H200 (16 cores): tests about 2.5 minutes (CuPy compiles the kernels once per
# process, then caches them on disk), benchmarks about 2.5.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results_gpu}"
mkdir -p "$out"
export OUT="$out" PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py="${PYTHON:-python3}"
budget="${BUDGET_S:-390}"
min_step=20  # MIN_STEP_S: less than this cannot even start Python with torch and CUDA
summary="$out/summary.txt"
status=0

# step NAME CAP_S COMMAND...: run COMMAND in the budget (see the note above), output to $out/NAME.log
step() {
  local name=$1 cap=$2
  shift 2
  local left=$(( budget - SECONDS ))
  if (( left < min_step )); then
    echo "gpu_check: $name skipped: ${left} s of the ${budget} s budget left" | tee -a "$summary"
    status=1
    return
  fi
  local limit=$(( cap < left ? cap : left )) start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  if (( rc == 124 || rc == 137 )); then
    echo "gpu_check: $name stopped at its limit of ${limit} s" | tee -a "$out/$name.log"
  fi
  echo "gpu_check: $name exit $rc in $(( SECONDS - start )) s (limit ${limit} s)" | tee -a "$summary"
  if (( rc != 0 )); then status=$rc; fi
}

"$py" - <<'PY' 2>&1 | tee "$summary"
import importlib, platform, torch
def version(name):
    try:
        module = importlib.import_module(name)
    except Exception as e:  # reported, not fatal: the steps that need it fail and say why
        return f"missing ({type(e).__name__})"
    return getattr(module, "__version__", None) or getattr(module, "VERSION", "?")
print("python", platform.python_version(), "| torch", torch.__version__, "cuda", torch.version.cuda, "|",
      torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU", "|",
      " | ".join(f"{n} {version(n)}" for n in ("cupy", "lightning", "safetensors", "xxhash", "pytest")))
PY

pytest_args=(-p no:cacheprovider -o addopts="" -q -rA)
step kernel_tests 150 "$py" -m pytest "${pytest_args[@]}" \
    tests/test_kernels_gpu.py tests/test_kernels.py tests/test_cuda_sources.py
# the CUDA tests among the engine's (the multi-rank file's cpu variants run in the normal suite)
step engine_tests 180 "$py" -m pytest "${pytest_args[@]}" -k "(gpu or cuda) and not cpu" \
    tests/test_engine_gpu.py tests/test_engine_gpu_multirank.py tests/test_activation_checkpointing.py
# issue 15's head-to-head: GPT-2 small through Lightning, a fresh process per strategy (DeepSpeed where
# its wheel was carried and installed; skipped otherwise)
step bench_gpt2 190 "$py" benchmarks/bench_gpt2_lightning.py --steps 20 \
    --variants plain,zero2,zero3,zero2_offload,zero2_offload_overlap,zero3_offload,zero3_offload_overlap,fsdp,deepspeed2,deepspeed3 \
    --out "$out/bench_gpt2.json"
step bench_kernels 60 "$py" benchmarks/bench_kernels.py --out "$out/bench_kernels.json"
step bench_fused_step 90 "$py" benchmarks/bench_fused_step.py --out "$out/bench_fused_step.json"
step bench_activations 30 "$py" benchmarks/bench_activations.py --n-embd 256 --seq 256 --batch 16 --repeats 3 --device cuda
step bench_offload 60 "$py" benchmarks/bench_offload.py --params-millions 50 --disk-params-millions 10 --steps 3 \
    --cuda-memory 100
step bench_stages 90 "$py" benchmarks/bench_stages.py --device cuda --params-millions 20 --steps 3

echo "gpu_check: exit $status after $SECONDS s of the ${budget} s budget; results in $out" | tee -a "$summary"
exit $status
