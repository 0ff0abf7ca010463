"""zero-estimate: per-rank model-state memory for each ZeRO stage, without training.

    zero-estimate                                     # the default GPT, on the default world
    zero-estimate model=gpt world_size=64             # same overrides as zero-train
    zero-estimate model.net.n_layer=48 model.net.n_embd=1600 world_size=256 precision=bf16-mixed offload=true

The model is built on the meta device (shapes only, no memory), so billion-parameter configs
are counted in a second; the numbers are zero_strategy.estimate_memory's (the ZeRO paper's
formula), like DeepSpeed's estimate_zero2/zero3_model_states_mem_needs.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

import hydra
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from ..memory import estimate_memory, normalize_precision
from .configs import config_dir, register_resolvers
from .errors import explain_failure
from .report import print_estimates
from .validate import check_config

USAGE = __doc__.split("\n\n")[1]


def count_parameters(model_cfg: DictConfig) -> int:
    """Parameters of the configured network, built on the meta device (no memory, no init cost).
    Counts unique parameters, so tied input/output embeddings count once, as ZeRO stores them."""
    node = model_cfg.get("net", model_cfg)  # the network alone: the LightningModule adds no parameters
    with torch.device("meta"):
        net = hydra.utils.instantiate(node)
    return sum(p.numel() for p in net.parameters())


def default_world_size(trainer_cfg: DictConfig) -> int:
    devices = trainer_cfg.get("devices", 1)
    if isinstance(devices, (list, tuple)) or hasattr(devices, "__len__") and not isinstance(devices, str):
        count = len(devices)
    elif isinstance(devices, int) and devices > 0:
        count = devices
    else:  # -1 or "auto": what this machine has
        count = torch.cuda.device_count() or 1
    return count * int(trainer_cfg.get("num_nodes", 1))


def estimate_rows(num_params: int, world_size: int, precision: str, offload: bool) -> list[dict[str, Any]]:
    rows = [{"stage": s, "offload": "", "estimate": estimate_memory(num_params, s, world_size, precision)}
            for s in (0, 1, 2, 3)]
    if offload:
        variants = [(2, "optimizer", False, False), (3, "optimizer", False, False), (3, "opt+params", True, False),
                    (3, "disk+params", True, True)]  # the presets zero2_offload, zero3_offload (+ offload_dir)
        rows += [{"stage": s, "offload": name,
                  "estimate": estimate_memory(num_params, s, world_size, precision, offload_optimizer=True,
                                              offload_params=par, offload_disk=disk)}
                 for s, name, par, disk in variants]
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(argv):
        print(USAGE.rstrip() + "\n\nAny zero-train override works (model=..., model.net.n_layer=..., precision=...).")
        return 0
    register_resolvers()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(config_dir()), version_base="1.3"):
            cfg = compose("estimate", overrides=argv)
        check_config(cfg, sections=("model",))
        if cfg.world_size is not None and (type(cfg.world_size) is not int or cfg.world_size < 1):
            raise ValueError(f"world_size={cfg.world_size!r} must be a positive integer (the number of ranks), "
                             "or null for what the trainer config would launch")
    except Exception as err:  # noqa: BLE001 - Hydra's message, then ours; no traceback for a typo
        print(f"zero-estimate: {type(err).__name__}: {err}", file=sys.stderr)
        explain_failure(argv, program="zero-estimate", config_name="estimate")
        return 2
    finally:
        GlobalHydra.instance().clear()
    world_size = cfg.world_size or default_world_size(cfg.trainer)
    precision = normalize_precision(cfg.trainer.precision)
    num_params = count_parameters(cfg.model)
    stage = cfg.strategy.get("stage", 0) if "zero" in str(cfg.strategy.get("_target_", "")).lower() else 0
    print_estimates(estimate_rows(num_params, world_size, precision, cfg.offload), num_params, world_size,
                    precision, stage, cfg.offload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
