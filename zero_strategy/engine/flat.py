"""Contiguous flat buffers: a group's parameters become views into one padded buffer.

[Note: master copies]
Low-precision (bf16/fp16) working weights get an fp32 ``master_shard``: this rank's slices, the
tensor the optimizer updates. After each step ``write_back()`` rounds it into the working copy
(the resident buffer's own slices, or the shard). fp32 weights, or half precision without master
weights ("bf16-true"), are their own master: the optimizer updates the working slices in place.

[Note: resident and sharded groups]
A *resident* group (stages 1 and 2, and small parameters at stage 3) keeps its full buffer on
every rank; the rank's shard is a set of slices of it. A *sharded* group (stage 3) keeps only
``shard``, the rank's slices copied out, and holds the full buffer only between ``gather()`` and
``release()``; while released, each parameter's ``.data`` is an empty tensor (``torch.Size([0])``).

[Note: freeing the full buffer]
Autograd keeps what a forward saved for backward, and for a linear layer that includes views of
the weight (its transpose): views of the gathered full buffer. Dropping our reference to the
buffer on release would therefore free nothing until backward, and every unit would stay in
memory from its forward to its backward. So a sharded group keeps one full buffer for its whole
life and ``release()`` resizes its *storage* to zero bytes, which frees the memory under every
view at once; ``gather()`` resizes the same storage back and all-gathers into it, so the views
autograd saved read the gathered values again by the time backward reaches the unit (its outputs'
hook gathers it first: see [Note: when units are gathered] in parameters.py). Touching a saved
view while its unit is released is an error, not a silent read of stale memory.

[Note: offloaded groups]
``offload_master`` puts the master shard in host memory (a copy even for fp32 weights, which are
then the device's working copy; see [Note: where offloaded bytes live] in offload.py).
``offload_shard`` (sharded groups only) keeps ``shard`` in host memory: ``gather()`` copies it to
the device for the all-gather. When both hold and the shard already has the master's dtype, the
shard is its own master.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .collectives import Collectives, Describe, Pending
from .layout import GroupLayout, Piece, Segment, align_elements, plan_group
from .offload import HOST, host_copy

_NO_BUCKET = 2**62  # a sharded group is one segment: one all-gather per gather


class FlatGroup:
    """Parameters that share a dtype and device, as views of one padded flat buffer.

    After construction every parameter's ``.data`` is a view of ``self.buffer`` (see
    [Note: segments] in layout.py); the Parameter objects themselves are unchanged, so the
    module, the user's optimizer and LR schedulers keep referring to them.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], world_size: int, rank: int,
                 bucket_numel: int = _NO_BUCKET, resident: bool = True,
                 broadcast_from: Optional[Collectives] = None, master_dtype: Optional[torch.dtype] = None,
                 offload_master: bool = False, offload_shard: bool = False) -> None:
        self.params = list(params)
        self.shapes = [p.shape for p in self.params]  # a released parameter's own shape is (0,)
        self.rank = rank
        self.resident = resident
        first = self.params[0]
        self.dtype, self.device = first.dtype, first.device
        self.layout: GroupLayout = plan_group(
            [p.numel() for p in self.params], world_size, bucket_numel, align_elements(first.element_size())
        )
        self.pieces: tuple[Piece, ...] = self.layout.pieces(rank)
        self.buffer: Optional[torch.Tensor] = torch.zeros(self.layout.numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for p, view in zip(self.params, self.param_views(self.buffer)):
                view.copy_(p.detach().reshape(view.shape))
        if broadcast_from is not None:  # every rank starts from rank 0's values, as DDP does
            broadcast_from.broadcast(self.buffer, src=0)
        self._point_params_at(self.buffer)
        own = torch.cat([self.own_shard_of(self.buffer, seg) for seg in self.segments])
        self.shard: Optional[torch.Tensor] = None
        if not resident:
            self.shard = host_copy(own, self.dtype, self.device) if offload_shard else own
        # see [Note: master copies] and [Note: offloaded groups]
        self.master_shard: Optional[torch.Tensor] = None
        if offload_master:
            want = master_dtype or self.dtype
            own_master = self.shard is not None and self.shard.device == HOST and self.shard.dtype == want
            self.master_shard = self.shard if own_master else host_copy(own, want, self.device)
        elif master_dtype not in (None, self.dtype):
            self.master_shard = own.to(master_dtype)
        self.offload_master, self.offload_shard = offload_master, offload_shard and not resident
        self._full: Optional[torch.Tensor] = None  # a sharded group's full buffer: see [Note: freeing the full buffer]
        if not resident:
            self._full = self.buffer
            self.release()

    @property
    def segments(self) -> tuple[Segment, ...]:
        return self.layout.segments

    @property
    def gathered(self) -> bool:
        return self.buffer is not None

    # ---- views -----------------------------------------------------------------------------

    @staticmethod
    def segment_of(buffer: torch.Tensor, seg: Segment) -> torch.Tensor:
        return buffer[seg.start : seg.start + seg.numel]

    def own_shard_of(self, buffer: torch.Tensor, seg: Segment) -> torch.Tensor:
        """This rank's shard of ``seg`` in a buffer laid out like ``self.buffer``."""
        lo, hi = seg.shard_range(self.rank)
        return buffer[lo:hi]

    def piece_of(self, buffer: torch.Tensor, piece: Piece) -> torch.Tensor:
        """The elements of ``piece`` in a buffer laid out like ``self.buffer``."""
        return buffer[piece.buffer_offset : piece.buffer_offset + piece.numel]

    def param_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """One view per parameter, shaped like it, into a buffer laid out like ``self.buffer``."""
        return [buffer[off : off + n].view(shape) for off, n, shape in
                zip(self.layout.param_offsets, self.layout.numels, self.shapes)]

    def master(self, piece: Piece) -> torch.Tensor:
        """The tensor the optimizer updates for ``piece``: see [Note: master copies]."""
        if self.master_shard is not None:
            return self.master_shard[piece.shard_offset : piece.shard_offset + piece.numel]
        if self.resident:
            assert self.buffer is not None
            return self.piece_of(self.buffer, piece)
        assert self.shard is not None
        return self.shard[piece.shard_offset : piece.shard_offset + piece.numel]

    def _point_params_at(self, buffer: torch.Tensor) -> None:
        for p, view in zip(self.params, self.param_views(buffer)):
            p.data = view

    # ---- moving parameters in and out (sharded groups) -------------------------------------

    def gather(self, comm: Collectives, what: Describe) -> list[Pending]:
        """Start all-gathering the full buffer; parameters point at it (valid once waited)."""
        assert not self.resident and self.shard is not None
        if self.buffer is not None:
            return []
        assert self._full is not None
        self._full.untyped_storage().resize_(self.layout.numel * self._full.element_size())
        self.buffer = self._full
        self._point_params_at(self.buffer)
        shard = self.shard.to(self.device, non_blocking=True)  # a host shard goes to the device first
        return [comm.all_gather(self.segment_of(self.buffer, seg),
                                shard[seg.shard_start : seg.shard_start + seg.shard_numel], what)
                for seg in self.segments]

    def release(self) -> None:
        """Free the full buffer's memory; parameters become empty until the next gather."""
        assert not self.resident
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for p in self.params:
            p.data = empty
        if self.buffer is not None:
            self.buffer.untyped_storage().resize_(0)  # also under autograd's saved views
        self.buffer = None

    def write_back(self, copy: bool = True) -> None:
        """After a step: round the fp32 master into the working weights (this rank's slices), and
        drop a sharded group's gathered copy, which no longer matches its shard. ``copy=False``:
        the pieces were written back already (``write_back_piece``); only release."""
        if self.resident:
            if copy and self.master_shard is not None:
                assert self.buffer is not None
                for seg in self.segments:
                    lo = seg.shard_start
                    self.own_shard_of(self.buffer, seg).copy_(self.master_shard[lo : lo + seg.shard_numel])
            return
        assert self.shard is not None
        if copy and self.master_shard is not None and self.master_shard is not self.shard:
            self.shard.copy_(self.master_shard)
        if self.buffer is not None:
            self.release()

    def write_back_piece(self, piece: Piece, start: int = 0, end: Optional[int] = None) -> None:
        """Round elements ``[start, end)`` of ``piece``'s master into the working weights without
        waiting: a copy from pinned host memory runs while the host goes on (see [Note: stepping in
        tiles] in offload.py); ``wait_for_copies`` before reading them."""
        if self.master_shard is None or self.master_shard is self.shard:
            return
        end = piece.numel if end is None else end
        lo = piece.shard_offset
        src = self.master_shard[lo + start : lo + end]
        if self.resident:
            assert self.buffer is not None
            dst = self.buffer[piece.buffer_offset + start : piece.buffer_offset + end]
        else:
            assert self.shard is not None
            dst = self.shard[lo + start : lo + end]
        dst.copy_(src, non_blocking=True)

    def adopt_params(self) -> None:
        """A resident group whose parameters were given other tensors (``module.cpu()`` and back):
        copy their values into the buffer and make them its views again."""
        assert self.resident and self.buffer is not None
        with torch.no_grad():
            for p, view in zip(self.params, self.param_views(self.buffer)):
                if p.data.data_ptr() != view.data_ptr():
                    view.copy_(p.data.reshape(view.shape))
        self._point_params_at(self.buffer)

    def master_from_weights(self) -> None:
        """A resident group's master slices from its (just loaded or edited) working weights."""
        assert self.resident and self.buffer is not None
        if self.master_shard is None or self.master_shard is self.shard:
            return
        for seg in self.segments:
            lo = seg.shard_start
            self.master_shard[lo : lo + seg.shard_numel].copy_(self.own_shard_of(self.buffer, seg))

    def save_own_slices(self) -> None:
        """Copy this rank's slices of the (gathered, edited) full buffer back into the shard."""
        assert self.buffer is not None and self.shard is not None
        for seg in self.segments:
            own = self.own_shard_of(self.buffer, seg)
            self.shard[seg.shard_start : seg.shard_start + seg.shard_numel].copy_(own)
            if self.master_shard is not None:
                self.master_shard[seg.shard_start : seg.shard_start + seg.shard_numel].copy_(own)
