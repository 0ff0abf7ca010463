"""Contiguous flat buffers: a group's parameters become views into one padded buffer.

Two kinds of group, one class each: a ``ResidentGroup`` keeps its full buffer on every rank (stages 1
and 2, and small parameters at stage 3); a ``ShardedGroup`` keeps only this rank's shard and holds the
full buffer between ``gather()`` and ``release()`` (stage 3). ``resident`` says which.

Three layouts of the same elements are addressed through a ``Piece`` (see [Note: pieces] in engine/buffers/layout.py):
the full *buffer* (``piece_of``), this rank's *shard* (``shard_slice``: the shard, the master and the
gradient shard are laid out alike), and the *parameter* (``piece.param_start/param_end``).

[Note: master copies]
Low-precision (bf16/fp16) working weights get an fp32 ``master_shard``: this rank's slices, the
tensor the optimizer updates (``stepped(piece)``). After each step ``write_back()`` rounds it into
the working weights (the resident buffer's own slices, or the shard). fp32 weights, or half precision
without master weights ("bf16-true"), are their own master: the optimizer updates the working slices
in place, and there is nothing to write back.

[Note: freeing the full buffer]
A sharded group's full buffer exists only between ``gather()`` and ``release()``, and comes from the
sharder's ``BufferPool`` (see [Note: reused buffers] in engine/buffers/pool.py): release gives it back, so the next
unit's gather, or this one's in backward, reuses the memory instead of allocating. Autograd keeps
what a forward saved for backward, and for a linear layer that includes a view of the weight: a
view of the gathered buffer, which would keep it out of the pool until backward. The saved-tensor
hooks of [Note: saved weights] (engine/params/saved_weights.py) keep the view's position instead, and rebuild
it over the buffer the group holds when backward reaches the unit (its outputs' hook gathers it
first: see [Note: when units are gathered] in engine/params/flat_parameters.py).

[Note: offloaded groups]
``offload_master`` puts the master shard in host memory (a copy even for fp32 weights, which are
then the device's working copy; see [Note: where offloaded bytes live] in engine/buffers/host.py).
``offload_shard`` (sharded groups only) keeps ``shard`` in host memory: ``gather()`` copies it to
the device for the all-gather. When both hold and the shard already has the master's dtype, the
shard is its own master.

[Note: quantized gathers]
With ``quantize`` (``quantized_weights``) each rank sends its shard of a segment as one packed row
(see [Note: packed rows] in engine/comm/quantize.py) and every rank dequantizes all the rows, its own included,
into the full buffer: every rank computes with the same weights, and gathering the unchanged shard
again (backward) gives the same ones. Only the full buffer is approximate: the shard, the master
and the optimizer step stay exact, and the gathers of checkpoints and ``gathered_parameters`` are
exact ones (``commit_gathered`` refuses a quantized buffer, which would round the shard).

[Note: secondary partition]
With ``keep_secondary`` (``secondary_partition_size`` K, ZeRO++'s hpZ) a forward gather also keeps
part l of each segment, l this rank's index among K consecutive ranks (one node's, or part of one):
the segment's l-th K-th, or, after a quantized gather, the l-th K-th of its packed rows (the rows of
primary shards l*N/K up to (l+1)*N/K), so that backward rebuilds exactly the forward's weights.
``gather_secondary`` all-gathers those parts within the K ranks, which then hold the whole
segment again, and no byte of it crosses a node. ``drop_secondary`` frees them once backward is
done with the unit.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

from ..comm.collectives import Collectives, Describe, Pending, after
from ..comm.quantize import QuantSpec, dequantize_into, packed_row_bytes, quantize_rows
from ..diagnose.breakdown import OFFLOAD
from ..diagnose.header import Header
from ..diagnose.ranges import span
from .host import HOST, host_copy
from .layout import GroupLayout, Piece, Segment, align_elements, plan_group
from .pool import BufferPool

_ONE_SEGMENT = 2**62  # a bucket larger than any group: one segment


class FlatGroup:
    """Parameters that share a dtype and device, as views of one padded flat buffer (see
    [Note: segments] in engine/buffers/layout.py). Build a ``ResidentGroup`` or a ``ShardedGroup``.

    The Parameter objects themselves are unchanged, so the module, the user's optimizer and LR
    schedulers keep referring to them; only their ``.data`` points into the buffer.
    """

    resident: bool

    def __init__(self, params: Sequence[torch.nn.Parameter], world_size: int, rank: int,
                 bucket_numel: int = _ONE_SEGMENT, broadcast_from: Optional[Collectives] = None,
                 master_dtype: Optional[torch.dtype] = None, offload_master: bool = False,
                 block_align: int = 1) -> None:
        """``block_align``: every parameter start and shard end also at a multiple of it (the int8
        optimizer state's block: see [Note: blocks that survive a reshard] in engine/optim/lowp.py)."""
        self.params = list(params)
        self.shapes = [p.shape for p in self.params]  # a released parameter's own shape is (0,)
        self.rank = rank
        first = self.params[0]
        self.dtype, self.device = first.dtype, first.device
        self.layout: GroupLayout = plan_group(
            [p.numel() for p in self.params], world_size, bucket_numel,
            math.lcm(align_elements(first.element_size()), block_align)
        )
        self.pieces: tuple[Piece, ...] = self.layout.pieces(rank)
        self.buffer: Optional[torch.Tensor] = self._new_buffer().zero_()  # padding stays zero in the shards
        with torch.no_grad():
            for p, view in zip(self.params, self.param_views(self.buffer)):
                view.copy_(p.detach().reshape(view.shape))
        if broadcast_from is not None:  # every rank starts from rank 0's values, as DDP does
            broadcast_from.broadcast(self.buffer, src=0, what=lambda: "broadcast of rank 0's initial parameters")
        self._point_params_at(self.buffer)
        self.offload_master = offload_master
        self.master_shard: Optional[torch.Tensor] = None  # see [Note: master copies]
        self.reduce_quantization: Optional[QuantSpec] = None  # how its gradients travel (quantized_gradients)
        self.reduce_dtype: Optional[torch.dtype] = None  # or in this dtype (low_precision_reduce_modules)
        self.before_master_write: Optional[Callable[[], None]] = None  # see prepare_master_write
        if master_dtype is not None and master_dtype.itemsize <= self.dtype.itemsize:
            master_dtype = None  # a master copy is wider than its weights: fp32 and fp64 weights are their own
        self._master_dtype = (master_dtype or self.dtype) if offload_master else master_dtype

    def _make_master(self, own: torch.Tensor, shard: Optional[torch.Tensor]) -> None:
        """The master shard from this rank's slices ``own`` (see [Note: offloaded groups])."""
        want = self._master_dtype
        if self.offload_master:
            is_own = shard is not None and shard.device == HOST and shard.dtype == want
            self.master_shard = shard if is_own else host_copy(own, want, self.device)
        elif want not in (None, self.dtype):
            self.master_shard = own.to(want)

    def _new_buffer(self) -> torch.Tensor:
        return torch.empty(self.layout.numel, dtype=self.dtype, device=self.device)

    @property
    def segments(self) -> tuple[Segment, ...]:
        return self.layout.segments

    @property
    def has_master_copy(self) -> bool:
        """Whether the optimizer steps a separate master (to be written back into the weights)."""
        return self.master_shard is not None and self.master_shard is not getattr(self, "shard", None)

    # ---- views -----------------------------------------------------------------------------

    @staticmethod
    def segment_of(buffer: torch.Tensor, seg: Segment) -> torch.Tensor:
        return buffer[seg.start : seg.start + seg.numel]

    def own_shard_of(self, buffer: torch.Tensor, seg: Segment) -> torch.Tensor:
        """This rank's shard of ``seg`` in a buffer laid out like ``self.buffer``."""
        lo, hi = seg.shard_range(self.rank)
        return buffer[lo:hi]

    @staticmethod
    def piece_of(buffer: torch.Tensor, piece: Piece) -> torch.Tensor:
        """The elements of ``piece`` in a buffer laid out like ``self.buffer``."""
        return buffer[piece.buffer_offset : piece.buffer_offset + piece.numel]

    @staticmethod
    def shard_slice(shard: torch.Tensor, piece: Piece, start: int = 0, end: Optional[int] = None) -> torch.Tensor:
        """Elements ``[start, end)`` of ``piece`` in a tensor laid out like this rank's shard (the
        shard, the master, a gradient shard)."""
        end = piece.numel if end is None else end
        return shard[piece.shard_offset + start : piece.shard_offset + end]

    @staticmethod
    def segment_shard(shard: torch.Tensor, seg: Segment) -> torch.Tensor:
        """Segment ``seg``'s part of a tensor laid out like this rank's shard."""
        return shard[seg.shard_start : seg.shard_start + seg.shard_numel]

    def param_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """One view per parameter, shaped like it, into a buffer laid out like ``self.buffer``."""
        return [buffer[off : off + n].view(shape) for off, n, shape in
                zip(self.layout.param_offsets, self.layout.numels, self.shapes)]

    def weights(self, piece: Piece) -> torch.Tensor:
        """The working weights of ``piece`` on this rank."""
        raise NotImplementedError

    def stepped(self, piece: Piece) -> torch.Tensor:
        """The tensor the optimizer updates for ``piece``: its master, or its working weights when
        they are their own master (see [Note: master copies])."""
        if self.master_shard is not None:
            return self.shard_slice(self.master_shard, piece)
        return self.weights(piece)

    def held_tensors(self) -> list[torch.Tensor]:
        """The working weights' storage held now (the master aside)."""
        raise NotImplementedError

    def _point_params_at(self, buffer: torch.Tensor) -> None:
        for p, view in zip(self.params, self.param_views(buffer)):
            p.data = view

    # ---- after a step ----------------------------------------------------------------------

    def shard_written(self) -> None:
        """This rank's slices were written (a step, a load). A resident group's buffer is where they
        live, so nothing is stale; a sharded group's gathered copy is."""

    def write_back(self) -> None:
        """Round the masters into this rank's working weights (nothing when they are their own)."""
        raise NotImplementedError

    def write_back_piece(self, piece: Piece, start: int = 0, end: Optional[int] = None) -> None:
        """Round elements ``[start, end)`` of ``piece``'s master into the working weights without
        waiting: a copy from pinned host memory runs while the host goes on (see [Note: stepping in tiles] in
        engine/optim/tiles.py); ``wait_for_copies`` before reading them."""
        if self.has_master_copy:
            assert self.master_shard is not None
            end = piece.numel if end is None else end
            self.weights(piece)[start:end].copy_(self.shard_slice(self.master_shard, piece, start, end),
                                                 non_blocking=True)

    def prepare_master_write(self) -> None:
        """Before the masters are written outside the optimizer's step: updates computed from their
        present values are dropped (see [Note: the overlapped host step] in engine/optim/step/overlap.py)."""
        if self.before_master_write is not None:
            self.before_master_write()

    def masters_from_weights(self) -> None:
        """The masters from the working weights (after these were loaded or edited whole)."""
        self.prepare_master_write()
        if self.has_master_copy:
            assert self.master_shard is not None
            for piece in self.pieces:
                self.shard_slice(self.master_shard, piece).copy_(self.weights(piece))


class ResidentGroup(FlatGroup):
    """A group whose full buffer lives on every rank; the rank's shard is a set of its slices."""

    resident = True

    def __init__(self, params: Sequence[torch.nn.Parameter], world_size: int, rank: int, **kwargs) -> None:
        super().__init__(params, world_size, rank, **kwargs)
        assert self.buffer is not None
        self._make_master(torch.cat([self.own_shard_of(self.buffer, seg) for seg in self.segments]), None)

    def weights(self, piece: Piece) -> torch.Tensor:
        assert self.buffer is not None
        return self.piece_of(self.buffer, piece)

    def held_tensors(self) -> list[torch.Tensor]:
        assert self.buffer is not None
        return [self.buffer]

    def write_back(self) -> None:
        if self.has_master_copy:
            assert self.buffer is not None and self.master_shard is not None
            for seg in self.segments:
                self.own_shard_of(self.buffer, seg).copy_(self.segment_shard(self.master_shard, seg))

    def adopt_params(self) -> None:
        """The parameters were given other tensors (``module.cpu()`` and back): copy their values into
        the buffer and make them its views again."""
        assert self.buffer is not None
        with torch.no_grad():
            for p, view in zip(self.params, self.param_views(self.buffer)):
                if p.data.data_ptr() != view.data_ptr():
                    view.copy_(p.data.reshape(view.shape))
        self._point_params_at(self.buffer)


class ShardedGroup(FlatGroup):
    """A group of which each rank keeps only its ``shard``; the full buffer exists while gathered,
    taken from ``pool`` (see [Note: freeing the full buffer]). ``offload_shard`` keeps the shard in
    host memory."""

    resident = False

    def __init__(self, params: Sequence[torch.nn.Parameter], world_size: int, rank: int,
                 offload_shard: bool = False, pool: Optional[BufferPool] = None, **kwargs) -> None:
        self.pool = pool if pool is not None else BufferPool()
        self.unit_name = "?"  # the unit's, for messages (set by Unit)
        super().__init__(params, world_size, rank, **kwargs)
        assert self.buffer is not None
        own = torch.cat([self.own_shard_of(self.buffer, seg) for seg in self.segments])
        self.offload_shard = offload_shard
        self.shard: torch.Tensor = host_copy(own, self.dtype, self.device) if offload_shard else own
        self.secondary: dict[int, torch.Tensor] = {}  # segment index -> part: see [Note: secondary partition]
        self.secondary_spec: Optional[QuantSpec] = None  # how the secondary parts are stored
        self.quantized = False  # the full buffer holds dequantized weights: see [Note: quantized gathers]
        self.stale = False  # the shard changed since the gather: see [Note: one record of a unit's gather] in
                            # engine/params/unit.py
        self._make_master(own, self.shard)
        self.release()

    def _new_buffer(self) -> torch.Tensor:
        return self.pool.take(self.layout.numel, self.dtype, self.device, owner=self)

    def weights(self, piece: Piece) -> torch.Tensor:
        return self.shard_slice(self.shard, piece)

    def held_tensors(self) -> list[torch.Tensor]:
        return [self.shard, *self.secondary.values()] + ([self.buffer] if self.buffer is not None else [])

    def _allocate(self) -> torch.Tensor:
        self.buffer = self._new_buffer()
        self._point_params_at(self.buffer)
        return self.buffer

    def gather(self, comm: Collectives, what: Describe, quantize: Optional[QuantSpec] = None,
               keep_secondary: Optional[Collectives] = None, header: Optional[Header] = None) -> list[Pending]:
        """Start all-gathering the full buffer; parameters point at it (valid once waited). ``header``
        rides in each all-gather (see [Note: the collective header] in engine/diagnose/header.py).

        ``quantize``: block-quantized (see [Note: quantized gathers]); ``keep_secondary``: also keep
        this rank's part over that group once gathered (see [Note: secondary partition]).
        """
        if self.buffer is not None and not self.stale:
            return []
        buffer = self.buffer if self.buffer is not None else self._allocate()  # a stale one: gathered again in place
        self.stale = False
        self.quantized = quantize is not None
        if keep_secondary is not None:
            self.secondary, self.secondary_spec = {}, quantize
        n = self.layout.world_size
        shard = self.shard
        if self.offload_shard:  # a host shard goes to the device first: the step's offload time
            with span(lambda: f"zero/offload shard to device {self.unit_name}"), \
                    comm.breakdown.waiting(OFFLOAD, "copy"):  # see [Note: profiler ranges], [Note: the step breakdown]
                shard = self.shard.to(self.device, non_blocking=True)
        pending = []
        for si, seg in enumerate(self.segments):
            out, own = self.segment_of(buffer, seg), self.segment_shard(shard, seg)
            if quantize is None:
                p = comm.all_gather(out, own, what, header)
                stored = out  # what the secondary part is cut from: the segment's elements
            else:
                rows = torch.empty((n, packed_row_bytes(seg.shard_numel, quantize)), dtype=torch.uint8,
                                   device=self.device)
                p = comm.all_gather(rows.view(-1), quantize_rows(own.view(1, -1), quantize).view(-1), what, header)
                p = after(p, lambda out=out, rows=rows, seg=seg: dequantize_into(rows, seg.shard_numel, quantize,
                                                                                 out.view(n, -1)))
                stored = rows  # its packed rows, so that backward rebuilds the forward's very weights
            if keep_secondary is not None:
                p = after(p, lambda si=si, stored=stored: self._keep_part(si, stored, keep_secondary))
            pending.append(p)
        return pending

    def _keep_part(self, si: int, stored: torch.Tensor, group: Collectives) -> None:
        """Keep this rank's K-th of segment ``si``'s elements or packed rows (K: ``group``'s ranks)."""
        part = stored.shape[0] // group.world_size
        self.secondary[si] = stored[group.rank * part : (group.rank + 1) * part].clone()

    def gather_secondary(self, comm: Collectives, what: Describe, header: Optional[Header] = None) -> list[Pending]:
        """Start all-gathering the full buffer from the secondary parts over ``comm``, the group they
        were kept over (see [Note: secondary partition])."""
        if self.buffer is not None:
            return []
        assert self.has_secondary, "no secondary partition was kept"
        buffer = self._allocate()
        spec, n = self.secondary_spec, self.layout.world_size
        self.quantized = spec is not None
        pending = []
        for si, seg in enumerate(self.segments):
            part = self.secondary[si]
            out = self.segment_of(buffer, seg)
            if spec is None:
                pending.append(comm.all_gather(out, part, what, header))
                continue
            rows = torch.empty((n, part.shape[1]), dtype=torch.uint8, device=self.device)
            p = comm.all_gather(rows.view(-1), part.view(-1), what, header)
            pending.append(after(p, lambda out=out, rows=rows, seg=seg:
                                 dequantize_into(rows, seg.shard_numel, spec, out.view(n, -1))))
        return pending

    @property
    def has_secondary(self) -> bool:
        return len(self.secondary) == len(self.segments) > 0

    def drop_secondary(self) -> None:
        self.secondary.clear()

    def release(self) -> None:
        """Give the full buffer back to the pool; parameters become empty until the next gather."""
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for p in self.params:
            p.data = empty
        self.stale = False
        if self.buffer is not None:
            buffer, self.buffer = self.buffer, None
            self.pool.give(buffer)

    def shard_written(self) -> None:
        """The shard was written (a step, a load): a gathered copy, and the secondary parts cut from it,
        no longer match. The unit gathers it again (see [Note: one record of a unit's gather] in
        engine/params/unit.py)."""
        self.stale = self.buffer is not None
        self.drop_secondary()

    def write_back(self) -> None:
        """Round the master into the shard."""
        if self.has_master_copy:
            assert self.master_shard is not None
            self.shard.copy_(self.master_shard)
        self.shard_written()

    def commit_gathered(self) -> None:
        """Keep this rank's slices of the gathered (edited or loaded) full buffer: into the shard, and
        the master."""
        assert self.buffer is not None
        if self.quantized:
            raise RuntimeError("these parameters were gathered quantized for a training step (quantized_weights): "
                               "keeping their values would round the exact shards. Edit or load them outside the "
                               "training step's forward and backward, where gathered_parameters gathers exactly.")
        self.prepare_master_write()
        for seg in self.segments:
            own = self.own_shard_of(self.buffer, seg)
            self.segment_shard(self.shard, seg).copy_(own)
            if self.master_shard is not None:
                self.segment_shard(self.master_shard, seg).copy_(own)
