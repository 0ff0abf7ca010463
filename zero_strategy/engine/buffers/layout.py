"""Pure sharding arithmetic: where each parameter lives in a flat buffer and what a rank owns.

No torch, no process group: everything here is integers, so it is tested exhaustively and fast.

[Note: segments]
A flat group (the trainable parameters of one param group that share a dtype and device) is one
contiguous buffer cut into *segments*: runs of whole, consecutive parameters of about one bucket
each. Every segment is padded to a multiple of ``world_size * align`` elements and split into
``world_size`` equal shards; rank r owns shard r of every segment. A segment is therefore the unit
of communication: its gradients are reduce-scattered straight from (stage 1) or into (stage 2) the
right places, and its parameters all-gathered back, with no copy into or out of a bucket buffer.
With one segment (the group fits in a bucket) a rank owns one contiguous slice of the group.

[Note: pieces]
A *piece* is the part of one parameter that lies in one rank's shard of a segment. The inner
optimizer steps one tensor per piece, so a parameter that received no gradient on any rank is
skipped exactly as torch skips a parameter whose ``.grad`` is None, and every piece keeps its own
step count, as the parameter would without sharding. A parameter with no elements has an empty
piece on every rank, so it gets optimizer state (a step count) as torch would give it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

ALIGN_BYTES = 16  # a 128-bit vector load never straddles a parameter or shard boundary


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def align_elements(element_size: int) -> int:
    """Alignment in elements for a dtype of ``element_size`` bytes (4 for fp32, 8 for bf16)."""
    return max(1, ALIGN_BYTES // element_size)


@dataclass(frozen=True)
class Segment:
    """A run of consecutive parameters, padded so that it splits into world_size equal shards."""

    index: int
    params: tuple[int, ...]  # indices into the flat group's parameter list
    offsets: tuple[int, ...]  # start of each parameter inside the segment, in elements
    numels: tuple[int, ...]
    start: int  # start of the segment inside the group's flat buffer
    numel: int  # padded size: a multiple of world_size * align
    shard_start: int  # start of this segment's shard inside a rank's flat shard
    world_size: int

    @property
    def shard_numel(self) -> int:
        return self.numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Rank's shard of this segment, as a range of the group's flat buffer."""
        lo = self.start + rank * self.shard_numel
        return lo, lo + self.shard_numel


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that one rank owns (see [Note: pieces])."""

    param: int  # index into the flat group's parameter list
    segment: int
    param_start: int  # range inside the flattened parameter
    param_end: int
    buffer_offset: int  # where the piece starts in the group's flat buffer
    shard_offset: int  # where the piece starts in the rank's flat shard

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


@dataclass(frozen=True)
class GroupLayout:
    """Segments of one flat group and the arithmetic that follows from them."""

    numels: tuple[int, ...]
    world_size: int
    align: int
    segments: tuple[Segment, ...]
    param_offsets: tuple[int, ...]  # start of each parameter in the flat buffer
    param_segments: tuple[int, ...]  # index of the segment holding each parameter

    @property
    def numel(self) -> int:
        """Padded size of the whole flat buffer."""
        return sum(s.numel for s in self.segments)

    @property
    def shard_numel(self) -> int:
        """Elements one rank owns (padding included)."""
        return self.numel // self.world_size

    def pieces(self, rank: int) -> tuple[Piece, ...]:
        """What ``rank`` owns, one piece per (parameter, segment) overlap, in buffer order."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside the world of size {self.world_size}")
        out = []
        for seg in self.segments:
            lo = rank * seg.shard_numel  # shard range in segment coordinates
            hi = lo + seg.shard_numel
            for p, off, n in zip(seg.params, seg.offsets, seg.numels):
                start, end = max(lo, off), min(hi, off + n)
                if n == 0:  # placed where its offset falls, clamped into this rank's shard
                    out.append(Piece(p, seg.index, 0, 0, seg.start + off, seg.shard_start + min(max(off, lo), hi) - lo))
                elif start < end:
                    out.append(Piece(p, seg.index, start - off, end - off, seg.start + start,
                                     seg.shard_start + start - lo))
        return tuple(out)


def plan_group(numels: Sequence[int], world_size: int, bucket_numel: int, align: int = 1) -> GroupLayout:
    """Pack parameters, in order, into segments of about ``bucket_numel`` elements.

    A segment is closed when the next parameter would take it past the bucket size; a parameter
    larger than a bucket gets a segment of its own. Each parameter starts on an ``align`` boundary.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    if bucket_numel < 1 or align < 1:
        raise ValueError(f"bucket_numel={bucket_numel} and align={align} must be positive")
    if any(n < 0 for n in numels):
        raise ValueError(f"parameter sizes must be non-negative, got {list(numels)}")

    runs: list[list[int]] = []
    used = 0
    for i, n in enumerate(numels):
        size = round_up(n, align)
        if not runs or (used > 0 and size > 0 and used + size > bucket_numel):  # empty ones always fit
            runs.append([])
            used = 0
        runs[-1].append(i)
        used += size

    segments = []
    start = shard_start = 0
    for index, run in enumerate(runs):
        offsets, off = [], 0
        for i in run:
            offsets.append(off)
            off += round_up(numels[i], align)
        numel = round_up(max(off, 1), world_size * align)
        segments.append(Segment(index, tuple(run), tuple(offsets), tuple(numels[i] for i in run),
                                start, numel, shard_start, world_size))
        start += numel
        shard_start += numel // world_size
    param_offsets = [0] * len(numels)
    param_segments = [0] * len(numels)
    for seg in segments:
        for p, off in zip(seg.params, seg.offsets):
            param_offsets[p] = seg.start + off
            param_segments[p] = seg.index
    return GroupLayout(tuple(numels), world_size, align, tuple(segments), tuple(param_offsets), tuple(param_segments))
