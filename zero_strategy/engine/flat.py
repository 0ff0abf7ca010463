"""Contiguous flat buffers: a group's parameters become views into one padded buffer."""

from __future__ import annotations

from typing import Sequence

import torch

from .layout import GroupLayout, Piece, Segment, align_elements, plan_group


class FlatGroup:
    """The trainable parameters of one param group that share a dtype and device.

    After construction every parameter's ``.data`` is a view of ``self.buffer`` (see
    [Note: segments] in layout.py); the Parameter objects themselves are unchanged, so the
    module, the user's optimizer and LR schedulers keep referring to them.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], user_group: int, world_size: int, rank: int,
                 bucket_numel: int) -> None:
        self.params = list(params)
        self.user_group = user_group  # index of the param group these came from
        self.rank = rank
        first = self.params[0]
        self.dtype, self.device = first.dtype, first.device
        self.layout: GroupLayout = plan_group(
            [p.numel() for p in self.params], world_size, bucket_numel, align_elements(first.element_size())
        )
        self.buffer = torch.zeros(self.layout.numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for p, off in zip(self.params, self.layout.param_offsets):
                view = self.buffer[off : off + p.numel()]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view(p.shape)
        self.pieces: tuple[Piece, ...] = self.layout.pieces(rank)

    @property
    def segments(self) -> tuple[Segment, ...]:
        return self.layout.segments

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
        return [buffer[off : off + p.numel()].view(p.shape) for p, off in zip(self.params, self.layout.param_offsets)]
