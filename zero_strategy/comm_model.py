"""Communication you can predict: the bytes each rank sends in one training step, without training.

[Note: the communication model]
``predict_step_bytes`` lays the model out exactly as the engine will (the same unit plan, flat
groups and segments, from engine/params/plan.py and engine/buffers/layout.py, on a module that may live on
the meta device) and lists the collectives of one training step:

- stage 3, forward: the root unit's all-gathers, then each unit's, once (quantized with
  ``quantized_weights``); backward: each unit's again (from the secondary partition, within its
  group, with ``secondary_partition_size``); with the order guard on, each of these all-gathers
  carries 16 bytes of header per rank of its group (see [Note: the collective header] in
  engine/diagnose/header.py), except on gloo (``backend="gloo"``) those of 1 MiB or more (see
  [Note: headers left out on gloo] in engine/comm/order_guard.py);
- every stage: one reduce-scatter per gradient segment (stages 2-3 in backward, per micro-batch;
  stage 1 once, before the step), quantized with ``quantized_gradients``;
- with ``broadcast_buffers`` and buffers, one broadcast of their bytes over all ranks before the
  forward of the first micro-batch (the front ends run the others inside DDP's no-sync; the first
  step after an evaluation pass broadcasts none, as DDP's: see [Note: buffers kept in step] in
  engine/params/buffer_sync.py);
- the step: one all-reduce of a byte per trainable parameter (which got a gradient), one of the
  overflow flag (fp16 loss scaling), one of the clipping norm (8 bytes), then the all-gathers of
  the parameters kept whole (every one at stages 1-2; the small, resident ones at stage 3).
- an optimizer stepped whole (``whole_parameters``: Muon, Adafactor, ``whole_parameter_step``; see
  [Note: whole-parameter step] in engine/optim/step/whole.py) adds the step's two all-to-alls over
  all ranks, in the masters' dtype: the rank's pieces' values and gradients and a flag per piece to
  the parameters' owners, then the owner's new values of the others' pieces back (pieces of a rank's
  own parameters stay). Owners differ per rank, so these bytes do too: ``rank`` picks one, by default
  the rank that sends most; with ``update_norm`` (``DeepSpeedMuon`` clipping its updates) one 8-byte
  all-reduce more.
- with ``shard_group_size=K`` (hybrid sharding: [Note: hybrid sharding] in engine/comm/topology.py) the
  groups are planned for K ranks, and every all-gather, reduce-scatter, the overflow flag and the
  norm run over the shard group of K; each reduce-scatter is followed by an all-reduce of its
  shard across the N/K replicas (with accumulation, at the boundary's backward only, unless
  ``replica_all_reduce="every_backward"``), and only the gradient mask stays over all N.

Each is costed by engine/comm/volume.py's ``sent_bytes`` (see [Note: bytes sent] there) and filed
as intra- or inter-node by its group, as the engine's counter files it, so a real run's
``comm_stats()`` equals the prediction to the byte. It assumes what the engine's order assumes:
every unit runs once per forward and is reached by backward (a block called twice is gathered
twice), and no evaluation pass or checkpoint falls inside the step.

Time is bytes over bandwidth, per link: ``intra_node / intra GB/s + inter_node / inter GB/s``,
with nothing overlapped with compute (an upper bound on what communication adds to a step when it
does not overlap, a lower bound on the time spent communicating).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch
from torch import nn

from .config import ZeroConfig
from .engine.diagnose.header import HEADER_BYTES
from .engine.comm.collectives import BROADCAST_GATHER_BYTES
from .engine.comm.volume import CommCounter, NodeLayout, sent_bytes
from .engine.buffers.flat import _ONE_SEGMENT
from .engine.comm.topology import resolve_shard_group_size
from .engine.buffers.layout import GroupLayout, align_elements, plan_group
from .engine.params.flat_parameters import split_groups
from .engine.comm.quantize import QuantSpec, packed_row_bytes
from .engine.diagnose.tally import TALLY_BYTES
from .engine.optim.step.whole import step_elements
from .engine.params.plan import plan_units

PHASES = ("forward", "backward", "step")
"""Where a training step's collectives happen (``predict_step_bytes(by_phase=True)``)."""



@dataclass(frozen=True)
class Links:
    """Bandwidth per rank of a cluster's links, in GB/s (10^9 bytes per second, one direction)."""

    intra_node_gbps: float
    inter_node_gbps: float
    source: str = "given"

    def seconds(self, stats: dict[str, int]) -> float:
        return stats["intra_node"] / (self.intra_node_gbps * 1e9) + stats["inter_node"] / (self.inter_node_gbps * 1e9)


CLUSTERS: dict[str, Links] = {
    # NVLink 4 (900 GB/s both ways per H100), one 400 Gb/s NDR InfiniBand NIC per GPU
    "dgx-h100": Links(450.0, 50.0, "DGX H100: NVLink 4, 8 x 400 Gb/s InfiniBand"),
    # NVLink 3 (600 GB/s both ways per A100), one 200 Gb/s HDR InfiniBand NIC per GPU
    "dgx-a100": Links(300.0, 25.0, "DGX A100: NVLink 3, 8 x 200 Gb/s InfiniBand"),
    # 8 GPUs on PCIe 4.0 x16 (about 25 GB/s in practice) sharing one 100 Gb/s Ethernet NIC
    "pcie-100gbe": Links(25.0, 12.5 / 8, "8 PCIe 4.0 GPUs per node sharing one 100 Gb/s Ethernet NIC"),
}
DEFAULT_CLUSTER = "dgx-h100"


def links(cluster: str = DEFAULT_CLUSTER, intra_node_gbps: Optional[float] = None,
          inter_node_gbps: Optional[float] = None) -> Links:
    """A preset of ``CLUSTERS``, with either bandwidth overridden."""
    if cluster not in CLUSTERS:
        raise ValueError(f"cluster={cluster!r} is not a preset; use one of {sorted(CLUSTERS)} and override "
                         "intra_node_gbps / inter_node_gbps for other hardware.")
    for name, value in (("intra_node_gbps", intra_node_gbps), ("inter_node_gbps", inter_node_gbps)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ValueError(f"{name}={value!r} must be a positive number of GB/s per rank.")
    preset = CLUSTERS[cluster]
    if intra_node_gbps is None and inter_node_gbps is None:
        return preset
    return Links(float(intra_node_gbps or preset.intra_node_gbps), float(inter_node_gbps or preset.inter_node_gbps),
                 f"{preset.source}, overridden")


@dataclass(frozen=True)
class _Group:
    layout: GroupLayout
    element_size: int
    trainable: bool


class _Step:
    """The collectives of one step, counted as the engine's counter counts them. ``shards`` is the
    number of ranks the flat groups are sharded over: the world's, or a shard group's under hybrid
    sharding, whose shards are then all-reduced over ``world_size / shards`` replicas (see [Note:
    hybrid sharding] in engine/comm/topology.py); intra- or inter-node is rank 0's groups'."""

    def __init__(self, nodes: NodeLayout, shards: int, gloo: bool = False) -> None:
        self.nodes = nodes
        self.shards = shards
        self.gloo = gloo  # large all-gathers leave their headers out
        self.world_inter = nodes.num_nodes > 1
        self.shard_inter = nodes.spans_nodes(list(range(shards)))
        self.replica_inter = nodes.spans_nodes(list(range(0, nodes.world_size, shards)))
        self.counter = CommCounter()
        self.phases = {phase: CommCounter() for phase in PHASES}
        self.phase = "forward"

    def add(self, kind: str, algorithm: str, nbytes: int, group_size: int, inter_node: bool) -> None:
        sent = sent_bytes(algorithm, nbytes, group_size)
        self.counter.add(kind, sent, inter_node)
        self.phases[self.phase].add(kind, sent, inter_node)

    def gather(self, group: _Group, quantize: Optional[QuantSpec], over: int, inter_node: bool,
               header: bool) -> None:
        """One group's all-gathers over ``over`` ranks (the shard group's, or a secondary group's);
        ``header``: each carries the order guard's (see [Note: the collective header])."""
        for seg in group.layout.segments:
            out = self.shards * packed_row_bytes(seg.shard_numel, quantize) if quantize \
                else seg.numel * group.element_size
            left_out = self.gloo and out >= BROADCAST_GATHER_BYTES  # see [Note: headers left out on gloo]
            out += over * HEADER_BYTES if header and not left_out else 0
            self.add("all_gather", "all_gather", out, over, inter_node)

    def reduce(self, group: _Group, quantize: Optional[QuantSpec], sum_replicas: bool = True) -> None:
        n = self.shards
        per_node, nodes = self.nodes.ranks_per_node, self.nodes.num_nodes
        hierarchical = n == self.nodes.world_size and per_node > 1 and nodes > 1  # the world's group only
        for seg in group.layout.segments:
            shard = seg.shard_numel
            if quantize is None:
                self.add("reduce_scatter", "reduce_scatter", seg.numel * group.element_size, n, self.shard_inter)
            elif hierarchical:  # two hops: see [Note: quantized reduce-scatter]
                self.add("reduce_scatter", "all_to_all", per_node * packed_row_bytes(nodes * shard, quantize),
                         per_node, False)
                self.add("reduce_scatter", "all_to_all", nodes * packed_row_bytes(shard, quantize), nodes, True)
            else:
                self.add("reduce_scatter", "all_to_all", n * packed_row_bytes(shard, quantize), n, self.shard_inter)
            replicas = self.nodes.world_size // n
            if replicas > 1 and sum_replicas:  # the shard, summed across the shard groups
                self.add("all_reduce", "all_reduce", shard * group.element_size, replicas, self.replica_inter)

    def add_sent(self, kind: str, sent: int, inter_node: bool) -> None:
        """Bytes counted as sent, as they are (an all-to-all of unequal parts)."""
        self.counter.add(kind, sent, inter_node)
        self.phases[self.phase].add(kind, sent, inter_node)

    def world_collective(self, kind: str, nbytes: int) -> None:
        self.add(kind, kind, nbytes, self.nodes.world_size, self.world_inter)

    def shard_collective(self, kind: str, nbytes: int) -> None:
        self.add(kind, kind, nbytes, self.shards, self.shard_inter)


def _groups(params: Sequence[nn.Parameter], config: ZeroConfig, world_size: int, element_size: Optional[int],
            one_segment: bool) -> list[_Group]:
    """The flat groups the sharder builds over ``params`` (see engine/params/flat_parameters.py ``_flatten``)."""
    out = []
    for ps in split_groups(params, {}):
        size = element_size or ps[0].element_size()
        bucket = _ONE_SEGMENT if one_segment else config.bucket_numel(size)
        out.append(_Group(plan_group([p.numel() for p in ps], world_size, bucket, align_elements(size)), size,
                          ps[0].requires_grad))
    return out


def predict_step_bytes(module: nn.Module, config: ZeroConfig, world_size: int, ranks_per_node: Optional[int] = None,
                       dtype: Optional[torch.dtype] = None, loss_scaling: bool = False,
                       clipping: bool = False, accumulation_steps: int = 1, order_checked: bool = True,
                       by_phase: bool = False, backend: str = "nccl", whole_parameters: bool = False,
                       rank: Optional[int] = None, update_norm: bool = False
                       ) -> dict[str, int] | dict[str, dict[str, int]]:
    """The bytes one rank sends in one training step of ``module`` under ``config`` (see [Note: the
    communication model]): the keys of ``comm_stats()``. ``dtype`` is the working weights' (default:
    the parameters' own); ``loss_scaling``
    (fp16) and ``clipping`` add their small all-reduces; ``order_checked``: the order guard's headers
    ride in the stage-3 all-gathers (see [Note: order guard] in engine/comm/order_guard.py; False: as
    with the guard turned off). With ``by_phase`` the same, per phase
    ("forward", "backward", "step"). ``backend``: the process group's; on "gloo" the stage-3
    all-gathers of 1 MiB or more send no header (see [Note: headers left out on gloo] in
    engine/comm/order_guard.py).
    ``whole_parameters`` (or ``config.whole_parameter_step``): the optimizer is stepped whole, which adds
    the step's all-to-alls of ``rank`` (None: of the rank that sends most) and, with ``update_norm``, the
    all-reduce of a norm over the updates (``DeepSpeedMuon`` with ``gradient_clipping``).
    ``module`` may be on the meta device.
    """
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps={accumulation_steps!r} must be a positive integer")
    nodes = NodeLayout(world_size, ranks_per_node if ranks_per_node is not None else world_size)
    shards = resolve_shard_group_size(config.shard_group_size, world_size, nodes.ranks_per_node) or world_size
    element_size = torch.empty(0, dtype=dtype).element_size() if dtype is not None else None
    params = list(dict.fromkeys(module.parameters()))
    step = _Step(nodes, shards, backend == "gloo")
    grads_q, weights_q = config.gradient_quantization, config.weight_quantization
    if config.stage == 3:
        first = element_size or params[0].element_size()
        plan = plan_units(module, config.shard_modules, config.param_persistence_threshold,
                          config.bucket_numel(first), config.unit_params, leaf_modules=config.leaf_modules)
        units = [_groups(u.params, config, shards, element_size, False) for u in plan.units]
        root = _groups(plan.root, config, shards, element_size, False)
        resident = _groups(plan.resident, config, shards, element_size, True)
    else:
        units, root = [], []
        resident = _groups([p for p in params if p.requires_grad], config, shards, element_size, False)
    guard = config.stage == 3 and config.check_unit_order and order_checked and shards > 1
    secondary = config.secondary_partition_size
    secondary_inter = secondary is not None and nodes.spans_nodes(list(range(secondary)))
    trainable = [g for g in [*(g for u in units for g in u), *root, *resident] if g.trainable]

    buffer_bytes = sum(b.numel() * (element_size if element_size and b.is_floating_point() else b.element_size())
                       for b in module.buffers())  # floating-point buffers in the working dtype, as converted
    for micro in range(accumulation_steps):
        step.phase = "forward"
        if micro == 0 and config.broadcast_buffers and buffer_bytes:
            step.world_collective("broadcast", buffer_bytes)
        if config.stage == 3:
            for unit in [root, *units]:  # the root first: its pre-forward hook runs before any unit's
                for g in unit:
                    step.gather(g, weights_q, shards, step.shard_inter, guard)
        step.phase = "backward"
        for unit in reversed(units):
            for g in unit:
                if secondary is not None:
                    step.gather(g, weights_q, secondary, secondary_inter, guard)
                else:
                    step.gather(g, weights_q, shards, step.shard_inter, guard)
        boundary = micro == accumulation_steps - 1
        if config.stage >= 2 and (not config.local_accumulation or boundary):
            for g in trainable:  # local accumulation: once, at the boundary (see engine/grads/accumulation.py)
                step.reduce(g, grads_q, sum_replicas=boundary or config.replica_all_reduce == "every_backward")
    step.phase = "step"
    if config.stage == 1:
        for g in trainable:
            step.reduce(g, grads_q)
    flags = sum(len(g.layout.numels) for g in trainable)
    if flags:
        # which parameters got a gradient, one byte each, and the tally (see engine/diagnose/tally.py)
        step.world_collective("all_reduce", flags + TALLY_BYTES)
    if loss_scaling:  # over the shard group: the replicas hold the same reduced shards
        step.shard_collective("all_reduce", 1)  # the overflow flag
    if clipping:
        step.shard_collective("all_reduce", 8)  # the squared norm, float64
    if (whole_parameters or config.whole_parameter_step) and trainable:
        _whole_step(step, trainable, config, world_size, shards, rank, update_norm)
    for g in resident:
        if g.trainable:
            for seg in g.layout.segments:
                step.shard_collective("all_gather", seg.numel * g.element_size)
    if by_phase:
        return {phase: c.current for phase, c in step.phases.items()}
    return step.counter.current


def _whole_step(step: _Step, trainable: list[_Group], config: ZeroConfig, world_size: int, shards: int,
                rank: Optional[int], update_norm: bool) -> None:
    """The whole-parameter step's two all-to-alls (and the norm of the updates) of ``rank``, or of the
    rank that sends most (see [Note: the communication model])."""
    if shards != world_size:
        raise ValueError(f"an optimizer stepped whole runs over all {world_size} ranks; shard_group_size="
                         f"{config.shard_group_size!r} (hybrid sharding) does not combine with it: leave it unset.")
    size = trainable[0].element_size
    size = 4 if config.master_weights and size < 4 else size  # the step exchanges masters and their gradients
    layouts = [g.layout for g in trainable]
    ranks = range(world_size) if rank is None else [rank]
    first, second = max((step_elements(layouts, world_size, r) for r in ranks), key=sum)
    step.add_sent("all_to_all", first * size, step.shard_inter)
    step.add_sent("all_to_all", second * size, step.shard_inter)
    if update_norm:
        step.shard_collective("all_reduce", 8)  # float64


VARIANTS: tuple[tuple[str, int, dict], ...] = (
    ("ZeRO-1", 1, {}),
    ("ZeRO-2", 2, {}),
    ("ZeRO-2 + qgZ int4", 2, {"quantized_gradients": "int4"}),
    ("ZeRO-3", 3, {}),
    ("ZeRO-3 + qwZ", 3, {"quantized_weights": True}),
    ("ZeRO-3 + hpZ", 3, {"secondary_partition_size": "node"}),
    ("ZeRO-2 + HSDP", 2, {"shard_group_size": "node"}),
    ("ZeRO-3 + HSDP", 3, {"shard_group_size": "node"}),
    ("ZeRO-3 + HSDP + qwZ", 3, {"shard_group_size": "node", "quantized_weights": True}),
    ("ZeRO-3 + HSDP + qgZ int4", 3, {"shard_group_size": "node", "quantized_gradients": "int4"}),
    ("ZeRO-3 + qgZ int8", 3, {"quantized_gradients": "int8"}),
    ("ZeRO-3 + qgZ int4", 3, {"quantized_gradients": "int4"}),
    ("ZeRO++ (qwZ+hpZ+qgZ4)", 3, {"quantized_weights": True, "secondary_partition_size": "node",
                                          "quantized_gradients": "int4"}),
)
"""The stage and option combinations ``zero-estimate`` prints ("node": the ranks per node; HSDP:
shard_group_size, MiCS)."""


def variant_rows(module: nn.Module, base: ZeroConfig, world_size: int, ranks_per_node: int, link: Links,
                 **kwargs) -> list[dict]:
    """Predicted bytes (``stats``, and per phase: ``phases``) and time per step for each of
    ``VARIANTS`` (those that make sense on this layout: hpZ and HSDP need several nodes of several
    ranks), from ``base``'s other settings; ``kwargs`` go to ``predict_step_bytes``."""
    rows = []
    whole = kwargs.get("whole_parameters") or base.whole_parameter_step
    for name, stage, options in VARIANTS:
        options = dict(options)
        if whole and "shard_group_size" in options:
            continue  # the whole-parameter step runs over all ranks
        if "node" in (options.get("secondary_partition_size"), options.get("shard_group_size")):
            if ranks_per_node < 2 or ranks_per_node == world_size:
                continue  # a group inside one node changes nothing or cannot exist here
            if options.get("secondary_partition_size") == "node":
                options["secondary_partition_size"] = ranks_per_node
        fields = dict(stage=stage, quantized_weights=False, quantized_gradients=None, secondary_partition_size=None,
                      shard_group_size=None,
                      offload_params=base.offload_params and stage == 3,
                      local_accumulation=base.local_accumulation and stage >= 2)
        config = replace(base, **{**fields, **options})
        phases = predict_step_bytes(module, config, world_size, ranks_per_node, by_phase=True, **kwargs)
        stats = {key: sum(p[key] for p in phases.values()) for key in next(iter(phases.values()))}
        rows.append({"variant": name, "stats": stats, "phases": phases, "config": config,
                     "seconds": link.seconds(stats)})
    return rows
