"""Hybrid sharding's gradient policy with accumulation: the replicas' all-reduce deferred to the
boundary (``replica_all_reduce="boundary"``; see [Note: hybrid sharding] in engine/comm/topology.py)."""

from __future__ import annotations

from .accumulation import Deferral


class DeferredReplicaSum(Deferral):
    """``replica_all_reduce="boundary"``: the segments whose gradient shard holds sums the replicas
    have not all-reduced yet (see [Note: hybrid sharding])."""

    def __init__(self) -> None:
        super().__init__()
        self.unsynced: set[tuple[int, int]] = set()  # (group, segment)
