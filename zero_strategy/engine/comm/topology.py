"""Hybrid sharding (HSDP, DeepSpeed's MiCS): which ranks shard together and which replicate.

[Note: hybrid sharding]
With ``shard_group_size=K`` the N ranks form N/K *shard groups* of K consecutive ranks (ranks
0..K-1, K..2K-1, ...), and each shard group runs ZeRO (stages 1-3) among itself: its flat layouts
are planned for K ranks, its parameters are all-gathered within it, and its gradients are
reduce-scattered within it. The shard groups hold the same shards: rank r of one group owns what
rank r of every other group owns. So after the in-group reduce-scatter each rank all-reduces its
gradient shard across its *replicate group* (the ranks with its index in every shard group: r,
K + r, 2K + r, ...). Every gradient is divided by N before the first sum, so the result is the
average over all N ranks, as DDP's. The optimizer then steps the same shard with the same gradient
in every replica, and the replicas stay equal without any further communication.

With K = the ranks per node (``shard_group_size="node"``), every all-gather and reduce-scatter stays
inside a node and only the gradient all-reduce (1/K of the gradients per rank) crosses nodes.

With accumulation, ``replica_all_reduce="boundary"`` (the default, as MiCS does) runs that
all-reduce once per optimizer step: a deferred backward (a micro-batch before the boundary, as
[Note: local accumulation] marks them) reduce-scatters within the group as usual and adds into the
shard, which then holds the group's sum only (``DeferredReplicaSum.unsynced``); the boundary's
backward adds that sum into its own reduce-scatter's result before all-reducing it, so each
micro-batch's gradient crosses the nodes once, inside one sum, and k micro-batches cost one
inter-node all-reduce instead of k. It needs no memory: the sum lives in the shard. The result
differs from ``"every_backward"`` only in the order of the additions. A step whose last backward was
deferred too all-reduces what is pending first (``ShardedGradientReducer.reduce``).
Checkpoints are written by the first shard group only (see checkpoint/sharded.py) and name K.

The engine's ``comm`` (a FlatParameters', a ZeroOptimizer's) is the shard group; the world's
collectives stay with ``world_comm`` for what concerns every rank (rank 0's initial values, which
parameters got gradients anywhere, checkpoints). Subgroups come from ``Collectives.split``, created
once, in the same order on every rank, and count into the world's counter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from .collectives import Collectives


def resolve_shard_group_size(size: Union[int, str, None], world_size: int, ranks_per_node: int) -> Optional[int]:
    """K for ``shard_group_size`` on this world, or None where it shards over all ranks (None, or K
    equal to the world size). Raises for a K that does not divide the world size."""
    if size is None:
        return None
    if size == "node":
        size = ranks_per_node
    assert isinstance(size, int)
    if world_size % size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(f"shard_group_size={size} does not divide the world size {world_size}: every rank needs a "
                         f"shard group of {size}. Use one of {divisors} (usually the devices per node, "
                         "shard_group_size=\"node\"), or None to shard over all ranks.")
    return None if size == world_size else size


@dataclass(frozen=True)
class HybridMesh:
    """N ranks as ``replicas`` shard groups of ``shard_size`` consecutive ranks (see [Note: hybrid sharding])."""

    world_size: int
    shard_size: int

    def shard_groups(self) -> list[list[int]]:
        k = self.shard_size
        return [list(range(start, start + k)) for start in range(0, self.world_size, k)]

    def replicate_groups(self) -> list[list[int]]:
        k = self.shard_size
        return [list(range(index, self.world_size, k)) for index in range(k)]

    def replica_of(self, rank: int) -> int:
        """Which shard group ``rank`` (of the world) is in: 0 for the first."""
        return rank // self.shard_size


@dataclass
class HybridGroups:
    """This rank's collectives under a mesh: its shard group and its replicate group."""

    mesh: HybridMesh
    world: Collectives
    shard: Collectives
    replicate: Collectives
    replica: int  # this rank's shard group, 0 for the first


def hybrid_groups(world: Collectives, size: Union[int, str, None]) -> Optional[HybridGroups]:
    """The shard and replicate groups for ``shard_group_size=size`` over ``world`` (a collective of every
    rank: the process groups are made here), or None where ``size`` shards over all ranks."""
    k = resolve_shard_group_size(size, world.world_size, world.nodes.ranks_per_node)
    if k is None:
        return None
    mesh = HybridMesh(world.world_size, k)
    shard = world.split(mesh.shard_groups())
    replicate = world.split(mesh.replicate_groups())
    return HybridGroups(mesh, world, shard, replicate, mesh.replica_of(world.rank))
