"""What a collective costs in bytes, the node layout that says which links they cross, and the
counter behind ``comm_stats()``.

[Note: bytes sent]
"Bytes sent" by a rank in one collective is what the bandwidth-optimal ring (or pairwise) algorithm
makes every rank send, for a buffer of B bytes over a group of n ranks:

    all-gather      (n-1)/n * B   B the gathered output: each rank forwards n-1 chunks of B/n
    reduce-scatter  (n-1)/n * B   B the input: each rank sends n-1 partial chunks
    all-reduce     2(n-1)/n * B   a reduce-scatter, then an all-gather
    broadcast       (n-1)/n * B   a chain: n-1 of the n ranks pass B on (the average per rank)
    all-to-all      (n-1)/n * B   B the input: each rank keeps one of its n chunks

These are NCCL's bus-bandwidth factors (nccl-tests' PERFORMANCE.md), rounded down to whole bytes
per collective; nothing is sent in a group of one. Every rank of a group sends the same amount, so
the figure does not depend on the rank. The counter (``CommCounter``) and the model
(zero_strategy/comm_model.py) both call ``sent_bytes``: they use one definition, and agree exactly.

Bytes are filed under what the engine asked for, at the cost of how the backend does it:
- on gloo a reduce-scatter runs as an all-to-all (see [Note: reduce-scatter on gloo] in
  engine/comm/collectives.py), which sends what a reduce-scatter sends: (n-1)/n * B on every backend.
- the quantized reduce-scatter (``quantized_gradients``) is one or two all-to-alls of packed rows
  (see [Note: quantized reduce-scatter] in engine/comm/collectives.py): filed under ``reduce_scatter``, at
  the all-to-all's cost of the packed bytes.
- quantized all-gathers (``quantized_weights``) are all-gathers of packed rows (scales included).

[Note: intra-node and inter-node bytes]
Ranks are numbered node by node, as torchrun and Lightning number them: node k holds global ranks
``[k * ranks_per_node, (k + 1) * ranks_per_node)``. A collective over a group whose ranks all live
on one node is *intra-node*; over a group that spans nodes it is *inter-node*, all of its bytes,
because a ring over several nodes moves at the pace of its slowest links (the paper's accounting
of ZeRO++ counts the same way). Without a node layout every rank is taken to be on one node.

Object collectives (settings, unit plans, checkpoint records: never inside a training step) are
not counted.
"""

from __future__ import annotations

import os
from typing import Optional

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")
"""The keys of ``comm_stats()`` besides ``total``, ``intra_node`` and ``inter_node``."""

_FACTOR = {"all_gather": (1, 1), "reduce_scatter": (1, 1), "all_reduce": (2, 1), "broadcast": (1, 1),
           "all_to_all": (1, 1)}  # (numerator, 1): times (n - 1) / n


def sent_bytes(algorithm: str, nbytes: int, group_size: int) -> int:
    """Bytes one rank sends for ``algorithm`` (a key of _FACTOR) on a buffer of ``nbytes`` over
    ``group_size`` ranks (see [Note: bytes sent])."""
    if group_size <= 1:
        return 0
    num, _ = _FACTOR[algorithm]
    return num * (group_size - 1) * nbytes // group_size


class NodeLayout:
    """Which node each global rank is on (see [Note: intra-node and inter-node bytes]).

    ``ranks_per_node`` None: ``$LOCAL_WORLD_SIZE`` (torchrun sets it), else every rank on one node.
    """

    def __init__(self, world_size: int, ranks_per_node: Optional[int] = None) -> None:
        source, given = "ranks_per_node", repr(ranks_per_node)
        if ranks_per_node is None and os.environ.get("LOCAL_WORLD_SIZE"):
            source, given = "$LOCAL_WORLD_SIZE", os.environ["LOCAL_WORLD_SIZE"]
            ranks_per_node = int(given) if given.isdigit() else None
            if ranks_per_node is None:
                given = ranks_per_node = f"{given!r}"  # not a number: refused below, by its text
        if ranks_per_node is None:
            ranks_per_node = world_size
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
            raise ValueError(f"{source}={given} must be a positive integer: the ranks (devices) each node runs.")
        if world_size % ranks_per_node:
            raise ValueError(f"{source}={ranks_per_node} does not divide the world size {world_size}: every node "
                             "must run the same number of ranks. Pass the devices per node of this launch.")
        self.world_size = world_size
        self.ranks_per_node = ranks_per_node

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, global_rank: int) -> int:
        return global_rank // self.ranks_per_node

    def spans_nodes(self, global_ranks: list[int]) -> bool:
        return len({self.node_of(r) for r in global_ranks}) > 1


def empty_stats() -> dict[str, int]:
    return {key: 0 for key in (*KINDS, "total", "intra_node", "inter_node")}


class CommCounter:
    """Bytes this rank sent, by kind and by link, in the step being counted and in the last one.

    ``end_step()`` closes the step (the optimizer step's end) and makes it the one ``last()``
    returns; ``begin_step()`` drops what was counted since the last ``end_step()`` (set-up, or an
    evaluation loop between training steps).
    """

    def __init__(self) -> None:
        self.current = empty_stats()
        self._last = empty_stats()

    def add(self, kind: str, sent: int, inter_node: bool) -> None:
        if sent:
            self.current[kind] += sent
            self.current["total"] += sent
            self.current["inter_node" if inter_node else "intra_node"] += sent

    def begin_step(self) -> None:
        self.current = empty_stats()

    def end_step(self) -> None:
        self._last, self.current = self.current, empty_stats()

    def last(self) -> dict[str, int]:
        """The bytes of the last closed step (a copy)."""
        return dict(self._last)
