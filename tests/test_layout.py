"""Sharding arithmetic of ``plan_group`` and ``GroupLayout.pieces``, checked exhaustively on small cases.

Pure integers, no torch and no process group. Every layout of a grid of small parameter lists,
world sizes, bucket sizes and alignments is checked against the invariants of [Note: segments]
and [Note: pieces] in zero_strategy/engine/buffers/layout.py, and against brute-force references that work element by
element.
"""

from __future__ import annotations

import itertools

import pytest

from zero_strategy.engine.buffers.layout import GroupLayout, Piece, align_elements, plan_group, round_up

SIZES = (0, 1, 2, 3, 5, 8, 17)  # empty, smaller than any world, odd, aligned, larger than small buckets
WORLD_SIZES = (1, 2, 3, 4)
ALIGNS = (1, 4, 8)
BUCKETS = (1, 2, 3, 4, 7, 8, 16, 33, 10**9)


def numel_lists(max_len: int = 3):
    """Every list of up to ``max_len`` parameter sizes drawn from SIZES (400 lists)."""
    for n in range(max_len + 1):
        yield from itertools.product(SIZES, repeat=n)


# ---- brute-force references ----------------------------------------------------------------


def reference_runs(numels, bucket_numel, align):
    """Next-fit packing, written as a scan over prefix sums rather than a running counter.

    A run starts at ``first``; it extends to the longest prefix whose aligned size fits in the
    bucket, and always takes at least one parameter; zero-size parameters always join the run.
    """
    sizes = [round_up(n, align) for n in numels]
    runs, first = [], 0
    while first < len(sizes):
        last = first + 1  # the first parameter is always taken
        while last < len(sizes) and (sizes[last] == 0 or sum(sizes[first : last + 1]) <= bucket_numel):
            last += 1
        # next-fit only closes a run on overflow once something is in it: a run whose
        # parameters are all empty so far keeps taking the next one whatever its size
        while last < len(sizes) and sum(sizes[first:last]) == 0:
            last += 1
            while last < len(sizes) and (sizes[last] == 0 or sum(sizes[first : last + 1]) <= bucket_numel):
                last += 1
        runs.append(tuple(range(first, last)))
        first = last
    return runs


def reference_pieces(layout: GroupLayout, rank: int) -> list[Piece]:
    """Pieces found by walking ``rank``'s shard of every segment one element at a time."""
    owner = {}  # buffer index -> (param, index inside the param)
    for p, (off, n) in enumerate(zip(layout.param_offsets, layout.numels)):
        for k in range(n):
            assert off + k not in owner, "two parameters share a buffer element"
            owner[off + k] = (p, k)
    pieces: list[Piece] = []
    for seg in layout.segments:
        lo, hi = seg.shard_range(rank)
        current = None  # [param, param_start, param_end, buffer_offset, shard_offset]
        for b in range(lo, hi):
            hit = owner.get(b)
            if hit is not None and current is not None and current[0] == hit[0] and current[2] == hit[1]:
                current[2] += 1
                continue
            if current is not None:
                pieces.append(Piece(current[0], seg.index, current[1], current[2], current[3], current[4]))
                current = None
            if hit is not None:
                current = [hit[0], hit[1], hit[1] + 1, b, seg.shard_start + (b - lo)]
        if current is not None:
            pieces.append(Piece(current[0], seg.index, current[1], current[2], current[3], current[4]))
        # a parameter with no elements has an empty piece on every rank (it still gets a step count)
        # (its shard offset is where its offset falls, clamped into the rank's shard)
        lo = rank * seg.shard_numel
        pieces += [Piece(p, seg.index, 0, 0, seg.start + off, seg.shard_start + min(max(off, lo), lo + seg.shard_numel) - lo)
                   for p, off, n in zip(seg.params, seg.offsets, seg.numels) if n == 0]
    return sorted(pieces, key=lambda piece: (piece.segment, piece.param))


# ---- invariants ----------------------------------------------------------------------------


def check_layout(numels, world_size, bucket_numel, align):
    ctx = f"numels={numels} world_size={world_size} bucket={bucket_numel} align={align}"
    layout = plan_group(list(numels), world_size, bucket_numel, align)
    sizes = [round_up(n, align) for n in numels]
    quantum = world_size * align

    assert layout.numels == tuple(numels), ctx
    assert layout.world_size == world_size and layout.align == align, ctx
    assert len(layout.param_offsets) == len(numels) == len(layout.param_segments), ctx

    # Segments: indexed in order, contiguous, padded to the quantum, shard starts accumulate.
    start = shard_start = 0
    for i, seg in enumerate(layout.segments):
        assert seg.index == i, ctx
        assert seg.world_size == world_size, ctx
        assert seg.start == start, ctx
        assert seg.shard_start == shard_start, ctx
        assert seg.numel > 0, ctx
        assert seg.numel % quantum == 0, ctx
        assert seg.shard_numel * world_size == seg.numel, ctx
        assert seg.shard_numel % align == 0, ctx  # every shard starts aligned
        used = sum(sizes[p] for p in seg.params)
        # padding is the least that makes the segment a multiple of the quantum (at least one quantum)
        assert seg.numel == round_up(max(used, 1), quantum), ctx
        # shards of the segment tile it, in rank order
        ranges = [seg.shard_range(r) for r in range(world_size)]
        assert ranges[0][0] == seg.start and ranges[-1][1] == seg.start + seg.numel, ctx
        for (a_lo, a_hi), (b_lo, b_hi) in zip(ranges, ranges[1:]):
            assert a_hi == b_lo and a_hi - a_lo == seg.shard_numel, ctx
        assert seg.numels == tuple(numels[p] for p in seg.params), ctx
        start += seg.numel
        shard_start += seg.shard_numel
    assert layout.numel == start, ctx
    assert layout.shard_numel == shard_start, ctx
    assert layout.numel == layout.shard_numel * world_size, ctx

    # Runs: consecutive, in order, every parameter in exactly one segment; matches the reference.
    flat = [p for seg in layout.segments for p in seg.params]
    assert flat == list(range(len(numels))), ctx
    assert [seg.params for seg in layout.segments] == reference_runs(numels, bucket_numel, align), ctx
    if not numels:
        assert layout.segments == () and layout.numel == 0, ctx

    # Greedy packing: a segment fits in the bucket unless it holds one parameter with elements
    # (zero-size parameters take no room); and a segment was only closed because the next
    # parameter would not have fitted.
    for seg in layout.segments:
        used = sum(sizes[p] for p in seg.params)
        nonempty = [p for p in seg.params if numels[p] > 0]
        if used > bucket_numel:
            assert len(nonempty) == 1, ctx
    for a, b in zip(layout.segments, layout.segments[1:]):
        assert sum(sizes[p] for p in a.params) + sizes[b.params[0]] > bucket_numel, ctx
    # A parameter larger than a bucket shares its segment with no other parameter that has elements.
    for p, n in enumerate(numels):
        if sizes[p] > bucket_numel:
            seg = layout.segments[layout.param_segments[p]]
            assert [q for q in seg.params if numels[q] > 0] == [p], ctx
            if all(m > 0 for m in numels):
                assert seg.params == (p,), ctx

    # Parameter offsets: aligned, inside their segment, non-overlapping, agree with the segment.
    for seg in layout.segments:
        for p, off in zip(seg.params, seg.offsets):
            assert layout.param_segments[p] == seg.index, ctx
            assert layout.param_offsets[p] == seg.start + off, ctx
            assert off % align == 0, ctx
            assert 0 <= off and off + numels[p] <= seg.numel, ctx
    for p in range(len(numels)):
        assert layout.param_offsets[p] % align == 0, ctx
    spans = sorted((layout.param_offsets[p], layout.param_offsets[p] + n) for p, n in enumerate(numels) if n)
    for (_, end), (nxt, _) in zip(spans, spans[1:]):
        assert end <= nxt, ctx

    # Pieces: together they cover every element of every parameter exactly once.
    coverage = [[0] * n for n in numels]
    for rank in range(world_size):
        pieces = layout.pieces(rank)
        assert list(pieces) == reference_pieces(layout, rank), f"{ctx} rank={rank}"
        assert [pc.buffer_offset for pc in pieces] == sorted(pc.buffer_offset for pc in pieces), ctx
        seen_params = set()
        shard_end = 0
        for pc in pieces:
            seg = layout.segments[pc.segment]
            lo, hi = seg.shard_range(rank)
            assert pc.param not in seen_params, ctx  # at most one piece per parameter and rank
            seen_params.add(pc.param)
            if numels[pc.param] == 0:  # every rank has the empty piece of an empty parameter
                assert pc.param_start == pc.param_end == 0, ctx
                assert pc.buffer_offset == layout.param_offsets[pc.param], ctx
                assert shard_end <= pc.shard_offset <= seg.shard_start + seg.shard_numel, ctx
                continue
            assert pc.numel > 0, ctx
            assert pc.segment == layout.param_segments[pc.param], ctx
            assert 0 <= pc.param_start < pc.param_end <= numels[pc.param], ctx
            assert pc.buffer_offset == layout.param_offsets[pc.param] + pc.param_start, ctx
            assert lo <= pc.buffer_offset and pc.buffer_offset + pc.numel <= hi, ctx
            assert pc.shard_offset == seg.shard_start + (pc.buffer_offset - lo), ctx
            assert seg.shard_start <= pc.shard_offset and pc.shard_offset + pc.numel <= seg.shard_start + seg.shard_numel, ctx
            assert pc.shard_offset >= shard_end, ctx  # pieces do not overlap inside the rank's shard
            shard_end = pc.shard_offset + pc.numel
            for k in range(pc.param_start, pc.param_end):
                coverage[pc.param][k] += 1
        assert shard_end <= layout.shard_numel, ctx
    for p, counts in enumerate(coverage):
        assert all(c == 1 for c in counts), f"{ctx}: parameter {p} covered {counts}"
    return layout


@pytest.mark.parametrize("align", ALIGNS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_invariants_exhaustive(world_size, align):
    count = 0
    for numels in numel_lists():
        for bucket in BUCKETS:
            check_layout(numels, world_size, bucket, align)
            count += 1
    assert count == 400 * len(BUCKETS)


@pytest.mark.parametrize("world_size", (1, 2, 3, 4, 7, 8))
def test_invariants_longer_lists(world_size):
    """Longer lists, so that several segments of several parameters each occur."""
    lists = [
        (3, 5, 7, 11, 13, 1, 0, 2, 9),
        (1,) * 12,
        (0,) * 5,
        (0, 0, 40, 0, 0, 1, 1),
        (16, 16, 16, 16, 16),
        (100, 1, 100, 1),
        (6, 2, 0, 31, 4, 4, 4),
    ]
    for numels in lists:
        for bucket in (1, 5, 8, 16, 20, 32, 64, 1000):
            for align in ALIGNS:
                check_layout(numels, world_size, bucket, align)


# ---- specific cases ------------------------------------------------------------------------


def test_reference_runs_is_a_real_reference():
    # guard against a reference that trivially agrees: pin a few hand-computed packings
    assert reference_runs([3, 3, 3], 6, 1) == [(0, 1), (2,)]
    assert reference_runs([3, 3, 3], 6, 4) == [(0,), (1,), (2,)]
    assert reference_runs([7, 1, 1], 4, 1) == [(0,), (1, 2)]
    assert reference_runs([0, 0, 9, 1], 4, 1) == [(0, 1, 2), (3,)]
    assert reference_runs([], 4, 1) == []


def test_single_segment_when_everything_fits():
    layout = check_layout((5, 3, 0, 1), world_size=4, bucket_numel=10**6, align=1)
    assert len(layout.segments) == 1
    seg = layout.segments[0]
    assert seg.params == (0, 1, 2, 3)
    assert seg.offsets == (0, 5, 8, 8)
    assert seg.numel == 12  # 9 elements padded to a multiple of 4
    # with one segment a rank owns one contiguous slice of the group
    assert [seg.shard_range(r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    # the empty parameter 2 has an empty piece on every rank, placed where offset 8 falls
    assert layout.pieces(0) == (Piece(0, 0, 0, 3, 0, 0), Piece(2, 0, 0, 0, 8, 3))
    assert layout.pieces(1) == (Piece(0, 0, 3, 5, 3, 0), Piece(1, 0, 0, 1, 5, 2), Piece(2, 0, 0, 0, 8, 3))
    assert layout.pieces(2) == (Piece(1, 0, 1, 3, 6, 0), Piece(2, 0, 0, 0, 8, 2), Piece(3, 0, 0, 1, 8, 2))
    assert layout.pieces(3) == (Piece(2, 0, 0, 0, 8, 0),)  # otherwise padding only


def test_aligned_offsets_and_multi_segment_shards():
    layout = check_layout((5, 3, 9), world_size=2, bucket_numel=8, align=4)
    # 5 -> 8 elements fills the bucket; 3 -> 4 and 9 -> 12 each start a new segment
    assert [s.params for s in layout.segments] == [(0,), (1,), (2,)]
    assert [s.numel for s in layout.segments] == [8, 8, 16]
    assert [s.start for s in layout.segments] == [0, 8, 16]
    assert [s.shard_start for s in layout.segments] == [0, 4, 8]
    assert layout.param_offsets == (0, 8, 16)
    assert layout.numel == 32 and layout.shard_numel == 16
    assert layout.pieces(0) == (Piece(0, 0, 0, 4, 0, 0), Piece(1, 1, 0, 3, 8, 4), Piece(2, 2, 0, 8, 16, 8))
    assert layout.pieces(1) == (Piece(0, 0, 4, 5, 4, 0), Piece(2, 2, 8, 9, 24, 8))


def test_parameter_larger_than_bucket_gets_its_own_segment():
    layout = check_layout((2, 50, 2, 2), world_size=3, bucket_numel=10, align=1)
    assert [s.params for s in layout.segments] == [(0,), (1,), (2, 3)]
    layout = check_layout((50,), world_size=2, bucket_numel=1, align=8)
    assert [s.params for s in layout.segments] == [(0,)]
    assert layout.segments[0].numel == 64


def test_greedy_packing_fills_buckets():
    layout = check_layout((4, 4, 4, 4, 4), world_size=1, bucket_numel=8, align=1)
    assert [s.params for s in layout.segments] == [(0, 1), (2, 3), (4,)]
    # alignment counts towards the bucket: 3 rounds to 4, so only two fit in 8
    layout = check_layout((3, 3, 3), world_size=1, bucket_numel=8, align=4)
    assert [s.params for s in layout.segments] == [(0, 1), (2,)]
    layout = check_layout((3, 3, 3), world_size=1, bucket_numel=9, align=1)
    assert [s.params for s in layout.segments] == [(0, 1, 2)]


def test_empty_and_tiny_parameters():
    layout = check_layout((0,), world_size=4, bucket_numel=8, align=4)
    assert layout.segments[0].numel == 16  # an all-empty segment still gives every rank an aligned shard
    assert [layout.pieces(r) for r in range(4)] == [(Piece(0, 0, 0, 0, 0, 0),)] * 4
    layout = check_layout((1,), world_size=4, bucket_numel=8, align=1)
    assert layout.pieces(0) == (Piece(0, 0, 0, 1, 0, 0),)
    assert all(layout.pieces(r) == () for r in (1, 2, 3))
    layout = check_layout((), world_size=2, bucket_numel=8, align=1)
    assert layout.numel == 0 and layout.shard_numel == 0 and layout.pieces(1) == ()


def test_align_elements():
    assert align_elements(4) == 4  # fp32
    assert align_elements(2) == 8  # bf16 / fp16
    assert align_elements(8) == 2  # fp64
    assert align_elements(1) == 16
    assert align_elements(32) == 1  # never below one element


def test_round_up():
    for n in range(0, 50):
        for m in range(1, 10):
            r = round_up(n, m)
            assert r % m == 0 and n <= r < n + m


# ---- bad inputs ----------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", (0, -1, -7))
def test_bad_world_size(world_size):
    with pytest.raises(ValueError, match=rf"world_size={world_size}\b"):
        plan_group([4, 4], world_size, 8)


@pytest.mark.parametrize("bucket", (0, -1))
def test_bad_bucket(bucket):
    with pytest.raises(ValueError, match=rf"bucket_numel={bucket}\b"):
        plan_group([4, 4], 2, bucket)


@pytest.mark.parametrize("align", (0, -4))
def test_bad_align(align):
    with pytest.raises(ValueError, match=rf"align={align}\b"):
        plan_group([4, 4], 2, 8, align)


@pytest.mark.parametrize("numels", ([-1], [3, -2, 5], [0, -100]))
def test_negative_numel(numels):
    bad = next(n for n in numels if n < 0)
    with pytest.raises(ValueError, match=rf"non-negative.*{bad}\b"):
        plan_group(numels, 2, 8)


@pytest.mark.parametrize("world_size", (1, 2, 4))
def test_rank_out_of_range(world_size):
    layout = plan_group([5, 3], world_size, 8)
    for rank in (-1, world_size, world_size + 3):
        with pytest.raises(ValueError, match=rf"rank={rank}\b.*size {world_size}\b"):
            layout.pieces(rank)
    for rank in range(world_size):
        layout.pieces(rank)  # the valid ranks are accepted
