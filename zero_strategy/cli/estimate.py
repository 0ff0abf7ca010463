"""zero-estimate: per-rank model-state memory and communication for each ZeRO stage, without training.

    zero-estimate                                     # the default GPT, on the default world
    zero-estimate model=gpt world_size=64             # same overrides as zero-train
    zero-estimate model.net.n_layer=48 model.net.n_embd=1600 world_size=256 precision=bf16-mixed offload=true
    zero-estimate world_size=64 comm.devices_per_node=8 comm.cluster=dgx-a100 comm.inter_node_gbps=12.5

The model is built on the meta device (shapes only, no memory), so billion-parameter configs
are counted in a second; the memory is zero_strategy.estimate_memory's (the ZeRO paper's
formula), like DeepSpeed's estimate_zero2/zero3_model_states_mem_needs. With more than one rank it
also prints the bytes each rank sends per training step, intra- and inter-node, for each stage and
ZeRO++ option, and the time they take on the cluster's links (zero_strategy.comm_model: the same
bytes a run's comm_stats() counts). An optimizer stepped whole (``model.optimizer._target_`` Muon,
Adafactor, a class with ``zero_whole_parameters``, or ``strategy.whole_parameter_step=true``) is
counted as it runs: its state on the parameters' owners, its two all-to-alls per step.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

import hydra
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from omegaconf import OmegaConf
from rich.table import Table

from ..comm_model import DEFAULT_CLUSTER, Links, links, variant_rows
from ..engine.comm.topology import resolve_shard_group_size
from ..engine.optim.checks import needs_whole_parameters
from ..config import ZeroConfig
from ..frontend.options import engine_arguments
from ..memory import PRECISION_DTYPES, estimate_memory, estimated_options, normalize_precision
from .configs import config_dir, register_resolvers
from .errors import explain_failure
from .report import console, format_bytes, print_estimates
from .validate import check_config

USAGE = __doc__.split("\n\n")[1]


def build_network(model_cfg: DictConfig) -> torch.nn.Module:
    """The configured network on the meta device (no memory, no init cost)."""
    node = model_cfg.get("net", model_cfg)  # the network alone: the LightningModule adds no parameters
    with torch.device("meta"):
        return hydra.utils.instantiate(node)


def count_parameters(model_cfg: DictConfig) -> int:
    """Parameters of the configured network, built on the meta device. Counts unique parameters, so
    tied input/output embeddings count once, as ZeRO stores them."""
    return sum(p.numel() for p in build_network(model_cfg).parameters())


def default_world_size(trainer_cfg: DictConfig) -> int:
    devices = trainer_cfg.get("devices", 1)
    if isinstance(devices, (list, tuple)) or hasattr(devices, "__len__") and not isinstance(devices, str):
        count = len(devices)
    elif isinstance(devices, int) and devices > 0:
        count = devices
    else:  # -1 or "auto": what this machine has
        count = torch.cuda.device_count() or 1
    return count * int(trainer_cfg.get("num_nodes", 1))


# what each row of estimate_rows sets itself; the configured strategy's other options that
# estimate_memory takes (memory.estimated_options) apply to the ZeRO stages' rows
ROW_OPTIONS = ("stage", "offload_optimizer", "offload_params")


def whole_parameter_sizes(net: torch.nn.Module, model_cfg: DictConfig, base: ZeroConfig) -> Optional[list[int]]:
    """The trainable parameters' sizes when the configured optimizer is stepped whole (see [Note:
    whole-parameter step]); None when it steps flat shards."""
    target = OmegaConf.select(model_cfg, "optimizer._target_")
    try:
        cls = hydra.utils.get_class(target) if target else None
    except Exception:  # noqa: BLE001 - not a class (a function building one): the option alone decides
        cls = None
    whole = base.whole_parameter_step or (isinstance(cls, type) and needs_whole_parameters(cls, base))
    return [p.numel() for p in dict.fromkeys(net.parameters()) if p.requires_grad] if whole else None


def estimate_rows(num_params: int, world_size: int, precision: str, offload: bool,
                  base: Optional[ZeroConfig] = None, whole: Optional[list[int]] = None) -> list[dict[str, Any]]:
    """The formula's rows per stage (and offload preset). ``base``'s options that estimate_memory takes
    (``estimated_options``: the low-precision step, local_accumulation, ...) count in the ZeRO stages'
    rows, not in DDP's (stage 0); the offload rows keep the fp32 step of the offload presets (the disk
    step has no other), and stage 1 accumulates locally anyway (local_accumulation is refused there).
    ``whole``: the parameters' sizes of an optimizer stepped whole (``whole_parameter_sizes``): the ZeRO
    stages' state is then the owners', and there are no offload rows (its step does not offload)."""
    def settings(stage: int, offloaded: bool = False) -> dict[str, Any]:
        if base is None or stage == 0:
            return {}
        out = {k: v for k, v in estimated_options(base).items() if k not in ROW_OPTIONS}
        if offloaded:
            out.update(optimizer_state_dtype="fp32", master_weights_dtype="fp32")
        if stage < 2:
            out["local_accumulation"] = False
        if whole is not None:
            out["whole_parameters"] = whole
        return out

    rows = [{"stage": s, "offload": "", "estimate": estimate_memory(num_params, s, world_size, precision, **settings(s))}
            for s in (0, 1, 2, 3)]
    if offload and whole is None:
        variants = [(2, "optimizer", False, False), (3, "optimizer", False, False), (3, "opt+params", True, False),
                    (3, "disk+params", True, True)]  # the presets zero2_offload, zero3_offload (+ offload_dir)
        rows += [{"stage": s, "offload": name,
                  "estimate": estimate_memory(num_params, s, world_size, precision, offload_optimizer=True,
                                              offload_params=par, offload_disk=disk, **settings(s, offloaded=True))}
                 for s, name, par, disk in variants]
    return rows


def engine_settings(strategy_cfg: DictConfig) -> ZeroConfig:
    """The ZeroConfig settings in the configured strategy (units, buckets, ...); defaults for DDP."""
    if "zero" not in str(strategy_cfg.get("_target_", "")).lower():
        return ZeroConfig()
    given = OmegaConf.to_container(strategy_cfg, resolve=True)
    return ZeroConfig(**engine_arguments(given))  # type: ignore[arg-type]  # the stage too: see variant_rows


def comm_layout(comm_cfg: Any, trainer_cfg: DictConfig, world_size: int) -> tuple[int, Links]:
    """(ranks per node, link bandwidths) from ``comm.*``: devices_per_node (null: the trainer's devices
    when they divide the world, else one node), cluster (a preset of comm_model.CLUSTERS) and the
    per-rank bandwidths that override it."""
    comm_cfg = comm_cfg or {}
    per_node = comm_cfg.get("devices_per_node")
    if per_node is None:
        devices = default_world_size(trainer_cfg) // int(trainer_cfg.get("num_nodes", 1))
        per_node = devices if world_size % devices == 0 else world_size
    if type(per_node) is not int or per_node < 1 or world_size % per_node:
        raise ValueError(f"comm.devices_per_node={per_node!r} must be a positive integer dividing world_size="
                         f"{world_size} (every node runs the same number of ranks).")
    return per_node, links(comm_cfg.get("cluster") or DEFAULT_CLUSTER, comm_cfg.get("intra_node_gbps"),
                           comm_cfg.get("inter_node_gbps"))


def print_comm(rows: list[dict], num_params: int, world_size: int, per_node: int, link: Links,
               precision: str) -> None:
    table = Table(title=f"Communication per rank per training step: {num_params:,} parameters, {world_size} ranks "
                        f"({world_size // per_node} nodes x {per_node}), {precision}")
    kinds = ["all_gather", "reduce_scatter", "all_reduce"]
    if any(row["stats"]["all_to_all"] for row in rows):  # an optimizer stepped whole
        kinds.append("all_to_all")
    for column in ("variant", *(k.replace("_", "-") for k in kinds), "intra-node", "inter-node", "total"):
        table.add_column(column, justify="left" if column == "variant" else "right", no_wrap=column == "variant")
    table.add_column("ms", justify="right")
    for row in rows:
        st = row["stats"]
        table.add_row(row["variant"], *(format_bytes(st[k]) for k in (*kinds, "intra_node", "inter_node", "total")),
                      f"{row['seconds'] * 1e3:,.2f}")
    out = console()
    out.print(table)
    out.print(f"Links per rank: {link.intra_node_gbps:g} GB/s within a node, {link.inter_node_gbps:g} GB/s between "
              f"nodes ({link.source}). Bytes are those the ring (or all-to-all) algorithm makes each rank send, on "
              "NCCL; a collective over ranks of several nodes counts as inter-node. Time is bytes over bandwidth, "
              "nothing overlapped with compute (ms). qwZ: quantized_weights (int8), hpZ: "
              "secondary_partition_size = devices per node, qgZ: quantized_gradients (qgZ4: int4), HSDP: "
              "shard_group_size = devices per node (DeepSpeed's MiCS), with accumulation all-reduced across "
              "nodes once per step.")


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
        world_size = cfg.world_size or default_world_size(cfg.trainer)
        per_node, link = comm_layout(cfg.get("comm"), cfg.trainer, world_size)
        base = engine_settings(cfg.strategy)
    except Exception as err:  # noqa: BLE001 - Hydra's message, then ours; no traceback for a typo
        print(f"zero-estimate: {type(err).__name__}: {err}", file=sys.stderr)
        explain_failure(argv, program="zero-estimate", config_name="estimate")
        return 2
    finally:
        GlobalHydra.instance().clear()
    precision = normalize_precision(cfg.trainer.precision)
    net = build_network(cfg.model)
    num_params = sum(p.numel() for p in net.parameters())
    stage = cfg.strategy.get("stage", 0) if "zero" in str(cfg.strategy.get("_target_", "")).lower() else 0
    # hybrid sharding: the model state is sharded over the shard group (see [Note: hybrid sharding])
    shards = resolve_shard_group_size(base.shard_group_size, world_size, per_node) or world_size
    whole = whole_parameter_sizes(net, cfg.model, base)
    print_estimates(estimate_rows(num_params, shards, precision, cfg.offload, base, whole), num_params, shards,
                    precision, stage, cfg.offload and whole is None, replicas=world_size // shards)
    if whole is not None:
        console().print("The optimizer is stepped whole (each parameter by one rank, see docs/trainer.md): at the ZeRO "
                        "stages a rank holds the state of the parameters it owns (the most loaded rank's here), and "
                        "each step adds two all-to-alls; it does not offload (no offload rows).")
    if world_size > 1:
        rows = variant_rows(net, base, world_size, per_node, link, dtype=PRECISION_DTYPES[precision],
                            loss_scaling=precision == "16-mixed", clipping=bool(cfg.trainer.get("gradient_clip_val")),
                            accumulation_steps=int(cfg.trainer.get("accumulate_grad_batches") or 1),
                            whole_parameters=whole is not None)
        print_comm(rows, num_params, world_size, per_node, link, precision)
    return 0


if __name__ == "__main__":
    sys.exit(main())
