"""Scripts written for DeepSpeed run on this package: with the import swapped, and with every name
renamed while DeepSpeed cannot be imported; their losses equal DeepSpeed 0.19's on the same script.

The two scripts in tests/scripts/deepspeed_style/ are written as DeepSpeed's published examples
are: ``classifier.py`` (the CIFAR-10 tutorial's shape: argparse with ``add_config_arguments``,
``init_distributed``, ``get_accelerator()``, ``initialize(args=args, model=net, model_parameters=
params, training_data=trainset, config=ds_config)``, ``engine.backward``, ``deepspeed.comm``) and
``transformer.py`` (``--deepspeed_config`` through ``initialize(args=args)``, ``loss.backward()`` or
``engine.scale(loss).backward()``, ``from deepspeed import comm as dist``, ``from
deepspeed.accelerator import get_accelerator``). Three variants of each run on 2 gloo ranks:
"swapped" (each ``import deepspeed`` / ``from deepspeed...`` line points at zero_strategy; the rest
unchanged), "renamed" (every ``deepspeed`` word becomes ``zero_strategy``) and, where DeepSpeed is
installed, the script itself under DeepSpeed (``DS_ACCELERATOR=cpu``). The first two run with
``import deepspeed`` blocked. fp32, ZeRO stages 0-3: the losses equal DeepSpeed's within 1e-5.
So does the transformer with ``torch_autocast`` (bf16) at stage 2, with ``lower_precision_safe_modules:
[]`` (every gradient reduced in fp32) and with DeepSpeed's default list (Linear gradients reduced in
bf16: bit for bit); at stage 3 DeepSpeed's own numbers under autocast differ from its stage 2 ones
(about 1e-3 in the first loss: at stage 3 it computes Linear layers with its own autograd function, a
matmul then an in-place bias add, which rounds differently from torch's fused bf16 addmm, and it
leaves ``torch.nn.functional.linear`` replaced for the rest of the process), so stage 3 is not
compared there, and the autocast runs go first.
DeepSpeedExamples' ``bf16_full`` config (bf16 weights with bf16 masters and optimizer state, the
forward under ``torch_autocast``) runs at stages 2 and 3 in each variant, and learns; against
DeepSpeed its losses agree to bf16's precision (relative 2**-8: DeepSpeed's torch AdamW computes the
update in bf16 arithmetic, this package in fp32, rounded into the bf16 weights and state
stochastically), and at stage 2 the losses before the first step are DeepSpeed's bit for bit (the
same bf16 forward under autocast). 
Process starts are few: each variant runs all its scripts and stages in one pair of processes, each
script through ``runpy`` as ``python script.py`` would run it. The swapped one runs in the worker
pool (tests/distributed.py); the renamed one and DeepSpeed's are started by ``zero-launch
--num_gpus 2`` (tests/scripts/deepspeed_style/run_variant.py), which shows the launcher at work: it
passes ``--local_rank=<i>`` and sets ``$LOCAL_SIZE``, as DeepSpeed's launcher does. (DeepSpeed's own
data loader starts worker processes, which the pool's daemonic workers cannot.)
"""

from __future__ import annotations

import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from .distributed import free_port, run_distributed

SCRIPTS = Path(__file__).parent / "scripts" / "deepspeed_style"
ROOT = Path(__file__).resolve().parents[1]
STAGES = (0, 1, 2, 3)
AUTOCAST = {"torch_autocast": {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}}
SAFE_MODULES = {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}  # DeepSpeed's default list: Linear, Conv
BF16_FULL = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
             "torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"}}  # DeepSpeedExamples' bf16_full.json
# the autocast and bf16 runs at stage 2 come first: a DeepSpeed stage-3 engine replaces torch.nn.functional.linear
# by its own function for the rest of the process, which rounds differently in bf16 (see the docstring)
TRANSFORMER_RUNS = [("stage2-autocast", 2, "torch", AUTOCAST), ("stage2-autocast-safe", 2, "torch", SAFE_MODULES),
                    ("stage2-bf16_full", 2, "torch", BF16_FULL)] + [
    (f"stage{s}", s, "torch", {}) for s in STAGES] + [("stage3-bf16_full", 3, "torch", BF16_FULL),
                                                       ("stage2-scale", 2, "scale", {})]
BF16_RTOL = 2.0**-8  # bf16 keeps 8 significant bits: the bf16_full runs against DeepSpeed (see the docstring)


def swapped(text: str) -> str:
    """Only the import lines changed: ``import deepspeed`` and ``from deepspeed... import``."""
    text = re.sub(r"^import deepspeed$", "import zero_strategy as deepspeed", text, flags=re.M)
    return re.sub(r"^from deepspeed(\.| )", r"from zero_strategy\1", text, flags=re.M)


def renamed(text: str) -> str:
    """Every ``deepspeed`` word renamed (``--deepspeed_config`` is another word and stays)."""
    return re.sub(r"\bdeepspeed\b", "zero_strategy", text)


def transformer_config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def prepare(folder: Path) -> dict[str, Path]:
    """Each variant's scripts, the transformer's configs and an import blocker (a ``deepspeed``
    package that raises when imported), under ``folder``."""
    variants = {"swapped": swapped, "renamed": renamed, "deepspeed": lambda text: text}
    for name, change in variants.items():
        (folder / name).mkdir(parents=True)
        for script in ("classifier.py", "transformer.py"):
            (folder / name / script).write_text(change((SCRIPTS / script).read_text()))
    for tag, stage, _, extra in TRANSFORMER_RUNS:
        (folder / f"{tag}.json").write_text(json.dumps({**transformer_config(stage), **extra}))
    blocker = folder / "blocker" / "deepspeed"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ModuleNotFoundError(\"import deepspeed is blocked by the test\", "
                                         "name='deepspeed')\n")
    return {name: folder / name for name in variants}


def _run(script: Path, argv: list[str]) -> None:
    saved = sys.argv
    sys.argv = [str(script), *argv]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = saved


def run_variant(rank: int, world_size: int, folder: str, variant: str) -> None:
    """Both scripts of ``variant`` on this rank, as a launcher would start them (its variables set)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size),
                      DS_ACCELERATOR="cpu")
    here = Path(folder) / variant
    blocked = variant != "deepspeed"
    saved = sys.modules.get("deepspeed")
    if blocked:
        sys.modules["deepspeed"] = None  # `import deepspeed` fails, even where it is installed
    try:
        for tag, stage, backward, _ in TRANSFORMER_RUNS:
            if variant == "deepspeed" and stage == 0:
                backward = "engine"  # DeepSpeed 0.19 refuses a direct backward at stage 0
            _run(here / "transformer.py", ["--deepspeed_config", str(Path(folder) / f"{tag}.json"),
                                           "--backward", backward, "--tag", tag, "--out", str(here)])
        _run(here / "classifier.py", ["--stages", *map(str, STAGES), "--out", str(here)])
    finally:
        if blocked:
            if saved is None:
                sys.modules.pop("deepspeed", None)
            else:
                sys.modules["deepspeed"] = saved


def results(folder: Path) -> dict:
    """What each rank wrote: {("classifier", stage) or ("transformer", tag): [rank 0's, rank 1's]}."""
    out: dict = {}
    for rank in (0, 1):
        classifier = json.loads((folder / f"classifier_rank{rank}.json").read_text())
        for stage in STAGES:
            out.setdefault(("classifier", stage), []).append(classifier[str(stage)])
        out.setdefault(("classifier", "launch"), []).append(classifier["launch"])
        for tag, *_ in TRANSFORMER_RUNS:
            path = folder / f"transformer_{tag}_rank{rank}.json"
            if path.exists():
                out.setdefault(("transformer", tag), []).append(json.loads(path.read_text()))
    return out


def close(ours: dict, theirs: dict, what: str, atol: float = 1e-5, deepspeed: bool = False) -> None:
    """Each run's losses within ``atol``; against DeepSpeed (``deepspeed``) the bf16_full runs to bf16's
    precision, and at stage 2 the losses before the first step equal."""
    import torch

    for key in theirs:
        if key[1] == "launch":
            continue
        bf16 = deepspeed and str(key[1]).endswith("bf16_full")
        for rank, (mine, other) in enumerate(zip(ours[key], theirs[key])):
            torch.testing.assert_close(torch.tensor(mine["losses"]), torch.tensor(other["losses"]),
                                       rtol=BF16_RTOL if bf16 else 0, atol=0 if bf16 else atol,
                                       msg=lambda m: f"{what} {key} rank {rank}: {m}")
            if bf16 and str(key[1]).startswith("stage2"):  # 2 micro-batches accumulate: both come before the first step
                assert mine["losses"][:2] == other["losses"][:2], (what, key, rank)
            assert mine["steps"] == other["steps"], (what, key)


def start_launch(folder: Path, arguments: list[str], blocked: bool) -> subprocess.Popen:
    """``zero-launch --num_gpus 2 ARGUMENTS`` started (``python -m``: the console script may not be installed)."""
    path = [str(folder / "blocker")] if blocked else []
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]  # a deepspeed installed in a folder
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, str(ROOT), *kept]), "DS_ACCELERATOR": "cpu"}
    command = [sys.executable, "-m", "zero_strategy.deepspeed.launcher", "--num_gpus", "2", "--master_port",
               str(free_port()), *arguments]
    return subprocess.Popen(command, env=env, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_launch(proc: subprocess.Popen) -> None:
    """Wait for a ``start_launch``; it must succeed."""
    try:
        out, err = proc.communicate(timeout=200)
    finally:
        proc.kill()
    assert proc.returncode == 0, f"{' '.join(proc.args)} failed:\n{out[-2000:]}\n{err[-4000:]}"


def launch(folder: Path, arguments: list[str], blocked: bool) -> None:
    finish_launch(start_launch(folder, arguments, blocked))


@pytest.fixture(scope="module")
def our_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepspeed_scripts")
    prepare(folder)
    # the launch first: its processes import while the pool's ranks wait on each other
    launched = start_launch(folder, [str(SCRIPTS / "run_variant.py"), str(folder), "renamed"], blocked=True)
    try:
        run_distributed(run_variant, 2, str(folder), "swapped")
    except BaseException:
        launched.kill()
        raise
    finish_launch(launched)
    return folder, {variant: results(folder / variant) for variant in ("swapped", "renamed")}


@pytest.mark.timeout(240)
def test_scripts_run_swapped_and_renamed_without_deepspeed_and_the_launcher_starts_them(our_runs):
    folder, runs = our_runs
    swapped_run, renamed_run = runs["swapped"], runs["renamed"]
    close(renamed_run, swapped_run, "renamed (launched) vs swapped (pool)", atol=1e-6)
    for stage in STAGES:
        ranks = swapped_run[("classifier", stage)]
        assert [r["stage"] for r in ranks] == [stage, stage] and [r["steps"] for r in ranks] == [3, 3]
        assert len(ranks[0]["losses"]) == 6 and ranks[0]["losses"] != ranks[1]["losses"]  # each rank its own data
    assert swapped_run[("classifier", "launch")][0] == {"local_rank_argument": -1, "world_size": 2,
                                                         "accelerator": "cpu"}
    for tag, *_ in TRANSFORMER_RUNS:
        r = swapped_run[("transformer", tag)][0]
        assert r["boundaries"] == [False, True] * 4 and r["steps"] == 4 and r["memory"], tag
        assert r["losses"][-1] < r["losses"][0] - 0.5, tag  # it learns
        assert r["device_count"] == 2  # the CPU accelerator reads $LOCAL_SIZE (run_variant sets it, as a launcher)
    close({("transformer", "stage2-scale"): swapped_run[("transformer", "stage2-scale")]},
          {("transformer", "stage2-scale"): swapped_run[("transformer", "stage2")]}, "scale(loss) vs loss.backward()",
          atol=0)
    launched = [json.loads((folder / "renamed" / f"launch_rank{r}.json").read_text()) for r in (0, 1)]
    assert launched == [{"local_rank_argument": r, "LOCAL_SIZE": "2"} for r in (0, 1)]  # zero-launch passed them


def build_deepspeeds_shm_op() -> None:
    """DeepSpeed's CPU accelerator compiles its shared-memory communication op the first time a
    process initializes deepspeed.comm: over a minute of C++ on a fresh machine, 2 minutes or more
    on a busy 2-core one, which the reference launch's limit must not have to cover. Build it once,
    here, into torch's extension cache, where the launched ranks find it."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, "-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()"],
                          env=env, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, f"building DeepSpeed's shm op failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


@pytest.mark.timeout(780)
def test_losses_equal_deepspeeds_on_the_same_scripts(our_runs):
    pytest.importorskip("deepspeed", reason="compare with DeepSpeed where it is installed")
    folder, runs = our_runs
    build_deepspeeds_shm_op()
    launch(folder, [str(SCRIPTS / "run_variant.py"), str(folder), "deepspeed"], blocked=False)
    theirs = results(folder / "deepspeed")
    assert ("transformer", "stage2-autocast") in theirs and len(theirs) == len(runs["swapped"])
    for variant, ours in runs.items():
        close(ours, theirs, f"{variant} vs DeepSpeed", deepspeed=True)
