"""How a ZeroOptimizer's update runs: the interface of its step backends, and what they step.

[Note: step backends]
The update of a rank's pieces runs in one of seven ways, one class each, in a file of its own,
chosen once when the ZeroOptimizer is built (``choose_step_backend`` in choice.py):

- ``TorchStep`` (torch_step.py): the inner optimizer's own step on the pieces' device;
- ``CpuTilesStep`` (cpu_tiles.py): the same on CPU, tile by tile (see [Note: the CPU step in tiles] in
engine/optim/tiles.py);
- ``FusedStep`` (fused.py): where the CUDA kernels run, the update fused with the unscaling,
  the clipping and the write-back (see [Note: the fused mixed-precision step] in engine/optim/step/grads.py);
  what the kernels do not take over steps as one of the two above;
- ``HostTilesStep`` (host.py): optimizer offload, on host tensors, tile by tile, each tile's
  write-back to the device overlapping the next tile (see [Note: offloaded step] in engine/optim/step/host.py);
- ``DiskStep`` (disk.py): the same with the elementwise state in files (``offload_dir``);
- ``OverlappedStep`` (overlap.py): the host step started during backward
  (``offload_overlap``: see [Note: the overlapped host step] in engine/optim/step/overlap.py);
- ``LowPrecisionStep`` (lowp.py): bf16 or int8 optimizer state, bf16 masters with stochastic
  rounding, tile by tile in fp32 scratch (see [Note: the low-precision step] in engine/optim/step/lowp.py), and
  ``LowPrecisionHostStep``, the same on offloaded pieces, the state encoded in host memory.

The ZeroOptimizer keeps what every mode shares: the pieces and their param groups, the reduced
gradients (``StepGradients``), clipping, the loss scaler, the all-gather of the updated weights
and the state dict. Its ``step()`` makes one call, ``update``, or ``discard`` when the loss scaler
skips the step. A backend also says, as class attributes, how the pieces are built for it
(``stepped``), what the inner optimizer is built with (``options``, ``group_options``) and where
the pieces live (``on_host``). A new mode is a new backend.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

from ....config import ZeroConfig
from ...buffers.flat import FlatGroup
from ...buffers.layout import Piece
from ..state import consolidate_state, shard_state
from ..tiles import Settings
from .grads import StepGradients


def master_dtypes(groups: Sequence[FlatGroup]) -> list[torch.dtype]:
    """The dtypes of the groups' master shards, of those that have one (the host step's tensors)."""
    return [g.master_shard.dtype for g in groups if g.master_shard is not None]


@dataclass(frozen=True)
class PieceRef:
    """One piece a ZeroOptimizer steps (see [Note: pieces] in engine/buffers/layout.py), as ``Stepped.pieces``
    lists them."""

    group_index: int  # into ZeroOptimizer.groups
    group: FlatGroup
    index: int  # into group.pieces
    piece: Piece
    tensor: torch.Tensor  # what the inner optimizer updates: the master, or the working weights
    param: torch.nn.Parameter
    param_group: int  # the user's param group


@dataclass
class Stepped:
    """What a ZeroOptimizer steps, shared with its backend: per flat group, each piece's tensor (the
    master, or the working weights: see [Note: master weights] in engine/optim/optimizer.py) and user param
    group, and the inner optimizer over those tensors (``cls`` re-created with ``kwargs``)."""

    groups: list[FlatGroup]
    tensors: list[list[torch.Tensor]]
    user_group: list[list[int]]
    inner: torch.optim.Optimizer
    kwargs: dict[str, Any]
    device: torch.device  # where the collectives run
    rank: int

    @property
    def cls(self) -> type:
        return type(self.inner)

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """The inner optimizer's state, keyed by the stepped tensors (read it here each time: torch's
        ``load_state_dict`` gives the inner optimizer a new dict). With disk offload, and for the pieces
        whose state is stored encoded (lowp.py), the elementwise entries are here only inside
        ``state_in_memory``."""
        return self.inner.state

    def state_of(self, tensor: torch.Tensor) -> dict[str, Any]:
        """One stepped tensor's state: the inner optimizer's own entry, or ``{}`` (not stored) before
        its first step; to add an entry, write ``state[tensor]``."""
        return self.inner.state.get(tensor, {})

    def master_dtypes(self) -> list[torch.dtype]:
        return master_dtypes(self.groups)

    def pieces(self) -> Iterator[PieceRef]:
        """Every piece stepped, with the tensor the inner optimizer updates for it."""
        for gi, (g, tensors, user_groups) in enumerate(zip(self.groups, self.tensors, self.user_group)):
            for pi, (piece, tensor, user_group) in enumerate(zip(g.pieces, tensors, user_groups)):
                yield PieceRef(gi, g, pi, piece, tensor, g.params[piece.param], user_group)

    def offsets(self) -> list[list[int]]:
        """Per group, each piece's first element in this rank's shard."""
        return [[p.shard_offset for p in g.pieces] for g in self.groups]

    def shard_ranges(self) -> list[list[tuple[int, int]]]:
        """Per group, each piece's elements ``[start, end)`` in this rank's shard."""
        return [[(p.shard_offset, p.shard_offset + p.numel) for p in g.pieces] for g in self.groups]

    def settings_of(self) -> Settings:
        """A piece's param group (index, hyperparameters as the inner optimizer has them now)."""
        settings = [{k: v for k, v in g.items() if k != "params"} for g in self.inner.param_groups]
        return lambda gi, pi: (self.user_group[gi][pi], settings[self.user_group[gi][pi]])

    def write_back(self) -> None:
        """Round every group's masters into its working weights (see [Note: master copies] in
        engine/buffers/flat.py)."""
        for g in self.groups:
            g.write_back()


class StepBackend:
    """One way of updating a ZeroOptimizer's pieces (see [Note: step backends]). The base does
    nothing beyond the update; backends override what their mode needs."""

    on_host = False
    """The pieces, their gradients and the optimizer state are host tensors (optimizer offload)."""
    defers_gradients = False
    """The reduced gradients stay as reduced, with one factor owed (see [Note: the fused mixed-precision step]
    in engine/optim/step/grads.py)."""
    own_settings: tuple[str, ...] = ()
    """Keys of the inner optimizer's param groups the backend sets, not the user (the host kernel choice)."""
    whole_parameters = False
    """Each parameter is stepped whole by one rank, its state kept there (see [Note: whole-parameter step]
    in engine/optim/step/whole.py)."""

    def __init__(self, stepped: Stepped, config: ZeroConfig, owner: Any) -> None:
        """``owner``: a weak proxy of the ZeroOptimizer, for backends that read it as it goes."""
        self.stepped = stepped

    @staticmethod
    def pieces_of(group: FlatGroup) -> list[torch.Tensor]:
        """The tensors the inner optimizer updates for ``group``'s pieces."""
        return [group.stepped(piece) for piece in group.pieces]

    @classmethod
    def options(cls, optimizer_cls: type, kwargs: dict[str, Any], dtypes: Sequence[torch.dtype]) -> dict[str, Any]:
        """The inner optimizer's constructor arguments, from the user's (``dtypes``: the masters')."""
        return kwargs

    @classmethod
    def build_inner(cls, optimizer_cls: type, groups: list[dict[str, Any]], kwargs: dict[str, Any]
                    ) -> torch.optim.Optimizer:
        """The inner optimizer over the pieces' tensors: the user's class re-created."""
        return optimizer_cls(groups, **kwargs)

    @classmethod
    def group_options(cls, optimizer_cls: type, group: dict[str, Any],
                      dtypes: Sequence[torch.dtype]) -> dict[str, Any]:
        """An inner param group's settings, from the user's."""
        return group

    @property
    def segment_listener(self) -> Optional[Any]:
        """Told by the gradient reducer when a segment's gradient reached its host shard, or None."""
        return None

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """The optimizer state: the inner optimizer's, keyed by the stepped tensors."""
        return self.stepped.state

    def full_state_dict(self, zopt: Any) -> dict[str, Any]:
        """``zopt``'s state in the unsharded layout of torch's ``state_dict()`` (a collective)."""
        with self.state_in_memory():
            return consolidate_state(zopt)

    def load_full_state_dict(self, zopt: Any, state_dict: dict[str, Any]) -> None:
        """The inverse of ``full_state_dict``, from any world size and stage (a collective)."""
        shard_state(zopt, state_dict)
        self.state_loaded()

    def update(self, grads: StepGradients) -> None:
        """Step every piece with a gradient in ``grads`` (reduced, unscaled and clipped, or owing
        ``grads.scale`` when deferred) and write the working weights; the inner optimizer's param
        groups hold the step's hyperparameters. The all-gathers come after."""
        raise NotImplementedError

    def gradients_reduced(self) -> None:
        """The reduction is done: what the step reads of the gradients may be read now."""

    def discard(self) -> None:
        """Work done ahead of the step is void (an overflow, ``zero_grad``, a state dict loaded)."""

    def state_loaded(self) -> None:
        """The inner optimizer's state and param groups were just loaded."""

    @contextlib.contextmanager
    def state_in_memory(self, decoded: bool = True) -> Iterator[None]:
        """Inside the block, ``stepped.state`` holds every piece's whole state (see ``materialized_state``);
        ``decoded=False`` leaves state kept in a stored form (``stored_state``) as it is."""
        yield

    def stored_state(self, key: tuple[int, int]) -> dict[str, Any]:
        """Piece ``key``'s (flat group, piece) state kept in a stored form of the backend's own (encoded),
        by state key: none here."""
        return {}

    def held(self) -> dict[str, list[torch.Tensor]]:
        """Memory the backend keeps of its own: ``master_params`` (shadows), ``pending_states``."""
        return {"master_params": [], "pending_states": []}

    def stats(self) -> dict[str, int]:
        """What the backend counts (``offload_overlap_stats``)."""
        return {}

    def disk_bytes(self) -> int:
        return 0

    def close(self) -> None:
        """Free what outlives a step (files, a worker thread) now."""
