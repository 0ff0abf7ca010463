"""zero-train: the Hydra app that trains any model/data/strategy combination in conf/.

    zero-train                                         # small GPT, stdlib corpus, ZeRO-2, every device
    zero-train strategy=zero1 model=gpt trainer.max_steps=20
    zero-train -m strategy=ddp,zero1,zero2             # one run per strategy, each launching its ranks
    zero-train ckpt_path=outputs/zero-train/<run>/checkpoints/last.ckpt trainer.max_steps=600

Everything a run writes goes under Hydra's output folder: .hydra/ (the composed config),
checkpoints/, csv/ (metrics), summary_rank<r>.json (final metrics, memory, parameter digest).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.callbacks import LambdaCallback
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, read_write

from .callbacks import MemoryTable, Throughput
from .configs import config_dir, register_resolvers
from .errors import explain_failure
from .report import print_config, print_final
from .validate import ConfigError, check_config

register_resolvers()

# Hydra flags that take a value and must reach the child ranks unchanged (which config to load)
_CONFIG_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")


def point_child_ranks_at_this_job() -> None:
    """[Note: child ranks under Hydra] Lightning's popen launcher starts ranks 1..N-1 by re-running
    this command with ``hydra.run.dir=<HydraConfig.run.dir>`` appended, so that they share the run
    folder. In a multirun that goes wrong twice: the command line still holds ``-m`` and the sweep
    (each child would run the whole sweep), and ``run.dir`` is not the job's folder (the sweep's
    ``sweep.dir/subdir`` is). So, for the time of this job, the command line becomes this job's own
    overrides and ``run.dir`` its output folder; ``run`` restores both afterwards."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return
    keep, args = [], sys.argv[1:]
    for i, arg in enumerate(args):
        if arg in _CONFIG_FLAGS and i + 1 < len(args):
            keep += [arg, args[i + 1]]
        elif arg.split("=", 1)[0] in _CONFIG_FLAGS:
            keep.append(arg)
    sys.argv = [sys.argv[0], *keep, *hydra_cfg.overrides.task]
    with read_write(hydra_cfg):
        hydra_cfg.run.dir = hydra_cfg.runtime.output_dir


def build(cfg: DictConfig) -> dict[str, Any]:
    """Instantiate in dependency order. Data first: the model's shapes are read from its config.
    The strategy before the Trainer, which takes it as an object. Callbacks and loggers last:
    they only observe. Nothing here starts processes; ``trainer.fit`` does."""
    datamodule = hydra.utils.instantiate(cfg.data)
    model = hydra.utils.instantiate(cfg.model)
    strategy = hydra.utils.instantiate(cfg.strategy)
    callbacks = [hydra.utils.instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    loggers = [hydra.utils.instantiate(c) for c in (cfg.get("logger") or {}).values() if c is not None]
    trainer = hydra.utils.instantiate(cfg.trainer, strategy=strategy, callbacks=callbacks,
                                      logger=loggers or False)
    return {"datamodule": datamodule, "model": model, "trainer": trainer}


def parameter_digest(module: torch.nn.Module) -> str:
    """SHA-256 of every parameter and buffer (by name): equal on all ranks iff they hold the same model."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def scalar_metrics(trainer: L.Trainer) -> dict[str, float]:
    return {k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1}


def summarize(trainer: L.Trainer, model: L.LightningModule, metrics: dict[str, float], seconds: float,
              output_dir: Path) -> dict[str, Any]:
    """Write summary_rank<r>.json (every rank) and print the final table (rank 0)."""
    throughput = next((c for c in trainer.callbacks if isinstance(c, Throughput)), None)
    memory = next((c for c in trainer.callbacks if isinstance(c, MemoryTable)), None)
    rate = throughput.per_second if throughput else None
    if rate is not None:
        metrics[f"throughput/{throughput.unit}_per_sec"] = rate
    ckpt = getattr(trainer.checkpoint_callback, "last_model_path", "") or ""
    summary = {
        "global_rank": trainer.global_rank, "world_size": trainer.world_size, "global_step": trainer.global_step,
        "seconds": round(seconds, 3), "metrics": metrics, "last_checkpoint": ckpt,
        "memory": {"measured": memory.measured, "formula": memory.formula, "num_params": memory.num_params,
                   "stage": memory.stage} if memory and memory.measured else None,
        "param_digest": parameter_digest(model),
    }
    (output_dir / f"summary_rank{trainer.global_rank}.json").write_text(json.dumps(summary, indent=1))
    if trainer.is_global_zero:
        print_final(metrics, {"steps": trainer.global_step, "ranks": trainer.world_size,
                              "fit time": f"{seconds:.1f} s", "last checkpoint": ckpt or "-",
                              "outputs": str(output_dir)})
    return summary


def run(cfg: DictConfig) -> float | None:
    """One training job (one of a multirun's). Returns the final validation loss, for sweepers."""
    saved_environ, saved_argv = dict(os.environ), list(sys.argv)
    try:
        point_child_ranks_at_this_job()
        check_config(cfg)
        output_dir = Path(cfg.paths.output_dir)
        if cfg.print_config:
            rank_zero_only(print_config)(cfg, HydraConfig.get().runtime.choices, str(output_dir))
        L.seed_everything(cfg.seed, workers=True)  # before building: model init is seeded too
        objects = build(cfg)
        trainer, model, datamodule = objects["trainer"], objects["model"], objects["datamodule"]
        # the step of fit's last validation: when it is the last step, the final validation is skipped
        validated_at = [-1]
        trainer.callbacks.append(LambdaCallback(
            on_validation_end=lambda t, m: validated_at.__setitem__(0, t.global_step)))
        start = time.perf_counter()
        trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
        seconds = time.perf_counter() - start
        metrics = scalar_metrics(trainer)  # trainer.validate replaces them: keep the training ones
        if cfg.final_validation and validated_at[0] != trainer.global_step:
            trainer.validate(model, datamodule=datamodule, verbose=False)
            metrics.update(scalar_metrics(trainer))
        summary = summarize(trainer, model, metrics, seconds, output_dir)
        return summary["metrics"].get("val/loss")
    finally:
        # gloo's threads can abort an exiting interpreter, and a multirun's next job needs a fresh group
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        # the launcher leaves LOCAL_RANK, WORLD_SIZE, MASTER_PORT... in os.environ; a next job seeing
        # them would believe it was started by a launcher and wait for ranks that never come
        os.environ.clear()
        os.environ.update(saved_environ)
        sys.argv = saved_argv


@hydra.main(config_path=str(config_dir()), config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> float | None:
    try:
        return run(cfg)
    except ConfigError as err:  # a mistake on the command line: the message says it all, no traceback
        print(f"zero-train: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def main() -> None:
    """Console entry point: Hydra's main, plus our explanation when the command line is wrong."""
    try:
        _hydra_main()
    except SystemExit as stop:
        if stop.code not in (0, None):
            explain_failure(sys.argv[1:])
        raise
    except Exception:
        explain_failure(sys.argv[1:])  # HYDRA_FULL_ERROR=1 lets Hydra's errors through as exceptions
        raise


if __name__ == "__main__":
    main()
