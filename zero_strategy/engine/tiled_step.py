"""The torch update of an elementwise optimizer, a tile at a time.

[Note: the CPU step in tiles]
torch's single-tensor Adam (its default on CPU) makes about ten passes over each parameter it
steps, several of them writing a temporary the size of the parameter (``sqrt``, ``div``). A piece
of a few MiB falls out of a core's cache between passes, and its temporaries are large blocks
that malloc hands out and takes back at every step (with [Note: glibc's mmap threshold] in
malloc.py, fresh pages each time). So on CPU the engine steps its pieces in tiles of
``CPU_TILE_NUMEL`` elements, cutting a piece where it is larger, each tile with a scratch
optimizer of the user's class (``step_views``). A tile's elementwise state is views of its piece's
state; its one-number state (the step count, and what derives from it) starts from a copy of the
piece's, which evolves alike in every tile, so any tile's result is the piece's (as with the state
on disk: [Note: optimizer state on disk] in offload.py). The update is elementwise, so the result
equals the whole step bit for bit: ``tests/test_tiled_step.py`` checks every optimizer of
``ELEMENTWISE_OPTIMIZERS`` with tiles that cut pieces at odd offsets.

AdamW over 16.7M fp32 elements on one core of the 2-core CI machine (1 MiB of L2 per core): 86 ms
whole, 29-35 ms in tiles of 64-128 Ki elements (scratch optimizers included), 67-72 ms in tiles of
256 Ki to 1 Mi (the tile's tensors no longer fit the cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from .state import is_elementwise

CPU_TILE_NUMEL = 1 << 17
"""Elements per tile of the CPU step: 512 KiB of fp32 per tensor, so that a tile's parameter,
gradient, state and temporaries stay in a core's L2 cache (see [Note: the CPU step in tiles])."""

PieceKey = tuple[int, int]  # (flat group index, piece index)


@dataclass(frozen=True)
class TilePart:
    """Elements ``[start, end)`` (of the rank's flat shard) of one piece, inside one tile."""

    group: int
    piece: int
    start: int
    end: int


def plan_tiles(shard_ranges: Sequence[Sequence[tuple[int, int]]], tile_numel: int,
               split_pieces: bool) -> list[list[TilePart]]:
    """Cut the pieces (``shard_ranges[group][piece] = (start, end)``) into tiles of about
    ``tile_numel`` elements, in order. Without ``split_pieces`` a piece larger than a tile is a
    tile of its own; with it, every tile holds at most ``tile_numel`` elements."""
    tiles: list[list[TilePart]] = []
    current: list[TilePart] = []
    used = 0
    for gi, ranges in enumerate(shard_ranges):
        for pi, (start, end) in enumerate(ranges):
            if not split_pieces:
                if current and used + (end - start) > tile_numel:
                    tiles.append(current)
                    current, used = [], 0
                current.append(TilePart(gi, pi, start, end))
                used += end - start
                continue
            while True:
                if used >= tile_numel:
                    tiles.append(current)
                    current, used = [], 0
                stop = min(end, start + tile_numel - used)
                current.append(TilePart(gi, pi, start, stop))
                used += stop - start
                if stop >= end:
                    break
                start = stop
    if current:
        tiles.append(current)
    return tiles


Settings = Callable[[int, int], Optional[tuple[int, dict[str, Any]]]]
"""``settings(group, piece)``: the piece's param group (index, hyperparameters), or None for a piece
the optimizer does not step."""

View = tuple[torch.Tensor, torch.Tensor, tuple[int, dict[str, Any]], dict[str, Any]]
"""(part of a piece, its gradient, its param group (index, hyperparameters), its state to start from)."""


def copy_scalar(value: Any) -> Any:
    """A copy of one-number state that the scratch optimizer may change in place (``step += 1``)."""
    return value.clone() if isinstance(value, torch.Tensor) else value


def step_views(cls: type, kwargs: dict[str, Any], views: Sequence[View]) -> dict[torch.Tensor, dict[str, Any]]:
    """One step of a scratch ``cls(groups, **kwargs)`` over ``views``; returns its state per view
    (elementwise state the optimizer updated in place is the views given; new state is new tensors)."""
    groups: dict[int, dict[str, Any]] = {}
    for t, grad, (index, hyper), _ in views:
        t.grad = grad
        groups.setdefault(index, {**hyper, "params": []})["params"].append(t)
    opt = cls(list(groups.values()), **kwargs)
    for t, _, _, entry in views:
        if entry:
            opt.state[t] = entry
    try:
        opt.step()
    finally:
        for t, *_ in views:
            t.grad = None
    return opt.state


class TiledStep:
    """Steps pieces tile by tile, their state in ``state`` (the inner optimizer's): see [Note: the
    CPU step in tiles]. Tile coordinates are offsets in the rank's flat shard of each group."""

    def __init__(self, tiles: list[list[TilePart]], cls: type, kwargs: dict[str, Any]) -> None:
        self.tiles = tiles
        self.cls = cls
        self.kwargs = kwargs

    def step(self, masters: Sequence[Sequence[torch.Tensor]], offsets: Sequence[Sequence[int]],
             grads: dict[PieceKey, torch.Tensor], state: dict[torch.Tensor, dict[str, Any]],
             settings: Settings) -> None:
        """One optimizer step of the pieces in ``grads`` (shaped like the pieces, 1-D)."""
        new: dict[torch.Tensor, dict[str, Any]] = {}  # state installed once every tile is done
        for tile in self.tiles:
            parts, views = [], []
            for part in tile:
                key = (part.group, part.piece)
                setting = settings(*key) if key in grads else None
                if setting is None:
                    continue
                master = masters[part.group][part.piece]
                lo, hi = part.start - offsets[part.group][part.piece], part.end - offsets[part.group][part.piece]
                entry = {k: v[lo:hi] if is_elementwise(v) else copy_scalar(v) for k, v in state.get(master, {}).items()}
                parts.append((master, lo, hi))
                views.append((master[lo:hi], grads[key][lo:hi], setting, entry))
            if not views:
                continue
            stepped = step_views(self.cls, self.kwargs, views)
            for (master, lo, hi), (t, *_) in zip(parts, views):
                for k, v in stepped[t].items():
                    if not is_elementwise(v):
                        new.setdefault(master, {})[k] = v
                        continue
                    whole = state.get(master, {}).get(k)
                    if not is_elementwise(whole):  # state the piece has from this step on (its first)
                        whole = new.setdefault(master, {}).get(k)
                        if whole is None:
                            whole = new[master][k] = torch.empty(master.numel(), dtype=v.dtype, device=v.device)
                    dst = whole[lo:hi]
                    if dst.data_ptr() != v.data_ptr():
                        dst.copy_(v.reshape(-1))
        for master, entry in new.items():
            state[master] = {**state.get(master, {}), **entry}
