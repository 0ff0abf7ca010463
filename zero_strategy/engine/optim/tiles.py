"""The torch update of an elementwise optimizer, a tile at a time.

[Note: the CPU step in tiles]
torch's single-tensor Adam (its default on CPU) makes about ten passes over each parameter it
steps, several of them writing a temporary the size of the parameter (``sqrt``, ``div``). A piece
of a few MiB falls out of a core's cache between passes, and its temporaries are large blocks
that malloc hands out and takes back at every step (with [Note: glibc's mmap threshold] in
engine/buffers/malloc.py, fresh pages each time). So on CPU the engine steps its pieces in tiles of
``CPU_TILE_NUMEL`` elements, cutting a piece where it is larger, each tile with a scratch
optimizer of the user's class over views of its parts, built at the first step and kept (its
hyperparameters set from the inner optimizer's at every step, for LR schedulers). A part's
elementwise state is a view of its piece's state; its one-number state (the step count, and what
derives from it) starts from a copy of the piece's, which evolves alike in every part, so any
part's result is the piece's (as with the state on disk: [Note: optimizer state on disk] in
engine/optim/step/disk.py); a piece in one tile steps its own state. The update is elementwise, so the result
equals the whole step bit for bit: ``tests/test_tiled_step.py`` checks every optimizer of
``ELEMENTWISE_OPTIMIZERS`` with tiles that cut pieces at odd offsets. The scratch optimizers step
without hooks; the inner optimizer's step fires its own and the global ones once. Only torch's own
classes are tiled: a subclass may keep state on the instance, which scratch optimizers would not
share, so it steps whole.

AdamW over 16.7M fp32 elements on one core of the 2-core CI machine (1 MiB of L2 per core): 86 ms
whole, 29-35 ms in tiles of 64-128 Ki elements (scratch optimizers included), 67-72 ms in tiles of
256 Ki to 1 Mi (the tile's tensors no longer fit the cache).

[Note: stepping in tiles]
The inner optimizer steps the pieces of a tile at a time: the pieces outside the tile have no
``.grad`` during that call, and every torch optimizer skips those. Since the update is
elementwise, several partial steps equal one whole step. After each tile its updated master
pieces start their (non-blocking) copy to the device while the host steps the next tile, so the
write-back overlaps the step.
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


def unhooked_step(opt: torch.optim.Optimizer) -> None:
    """``opt.step()`` without the step hooks (its own and the global ones) and the profiler's record:
    a scratch optimizer's step, or the inner optimizer's over one tile, is a part of the inner
    optimizer's step, which ``ZeroOptimizer`` runs as one hooked call (``hooked_step``)."""
    step = type(opt).step
    if getattr(step, "hooked", False):  # torch's wrapper (Optimizer._patch_step_function)
        step = step.__wrapped__  # type: ignore[attr-defined]
    step(opt)


def hooked_step(opt: torch.optim.Optimizer, step: Callable[[], None]) -> None:
    """Run ``step`` as ``opt``'s step: its step hooks and the global ones fire once, around it."""
    torch.optim.Optimizer.profile_hook_step(lambda _: step())(opt)


def step_views(cls: type, kwargs: dict[str, Any], views: Sequence[View]) -> dict[torch.Tensor, dict[str, Any]]:
    """One step of a scratch ``cls(groups, **kwargs)`` over ``views`` (without hooks: see
    ``unhooked_step``); returns its state per view (elementwise state the optimizer updated in place
    is the views given; new state is new tensors)."""
    groups: dict[int, dict[str, Any]] = {}
    for t, grad, (index, hyper), _ in views:
        t.grad = grad
        groups.setdefault(index, {**hyper, "params": []})["params"].append(t)
    opt = cls(list(groups.values()), **kwargs)
    for t, _, _, entry in views:
        if entry:
            opt.state[t] = entry
    try:
        unhooked_step(opt)
    finally:
        for t, *_ in views:
            t.grad = None
    return opt.state


@dataclass
class _Part:
    """A part of a piece in one tile, and the view of it that the tile's scratch optimizer steps."""

    key: PieceKey
    master: torch.Tensor  # the piece's tensor (whole)
    lo: int  # the part's elements in the piece
    hi: int
    view: torch.Tensor  # master[lo:hi]

    @property
    def whole(self) -> bool:
        return self.lo == 0 and self.hi == self.master.numel()

    @property
    def last(self) -> bool:
        return self.hi == self.master.numel()


class TiledStep:
    """Steps pieces tile by tile, their state in ``state`` (the inner optimizer's): see [Note: the
    CPU step in tiles]. Tile coordinates are offsets in the rank's flat shard of each group. Each
    tile keeps its scratch optimizer from step to step (built at the first), its hyperparameters
    set from ``settings`` at every step."""

    def __init__(self, tiles: list[list[TilePart]], cls: type, kwargs: dict[str, Any],
                 masters: Sequence[Sequence[torch.Tensor]], offsets: Sequence[Sequence[int]]) -> None:
        """``masters[group][piece]``: the tensors stepped (1-D), starting at ``offsets[group][piece]``
        in the shard; kept for good (the scratch optimizers hold views of them)."""
        self.tiles = tiles
        self.cls = cls
        self.kwargs = kwargs
        self.masters = masters
        self.offsets = offsets
        self._scratch: Optional[list[tuple[torch.optim.Optimizer, list[_Part], list[PieceKey]]]] = None

    def _build(self, settings: Settings) -> None:
        """Per tile: its scratch optimizer (a param group per param group of the user's), its parts, and
        for each of the scratch's param groups a piece that reads its hyperparameters."""
        self._scratch = []
        for tile in self.tiles:
            parts, groups, reader = [], {}, {}
            for p in tile:
                key = (p.group, p.piece)
                setting = settings(*key)
                if setting is None:
                    continue
                master = self.masters[p.group][p.piece]
                lo, hi = p.start - self.offsets[p.group][p.piece], p.end - self.offsets[p.group][p.piece]
                part = _Part(key, master, lo, hi, master[lo:hi])
                parts.append(part)
                groups.setdefault(setting[0], {**setting[1], "params": []})["params"].append(part.view)
                reader.setdefault(setting[0], key)
            if parts:
                opt = self.cls(list(groups.values()), **self.kwargs)
                opt.state.clear()  # Adagrad's constructor makes state: the pieces have theirs in ``state``
                self._scratch.append((opt, parts, list(reader.values())))

    def step(self, grads: dict[PieceKey, torch.Tensor], state: dict[torch.Tensor, dict[str, Any]],
             settings: Settings) -> None:
        """One optimizer step of the pieces in ``grads`` (shaped like the pieces, 1-D). A piece's new
        state is installed once its last part is stepped; an error inside the step leaves the pieces
        before it stepped and the rest not, as torch's step over several tensors does, except that a
        piece cut by the tile where it happened has only its first parts stepped."""
        if self._scratch is None:
            self._build(settings)
        assert self._scratch is not None
        new: dict[int, dict[str, Any]] = {}  # id(master) -> state taking effect at its last part
        for opt, parts, readers in self._scratch:
            live = [p for p in parts if p.key in grads]
            if not live:
                continue
            for group, key in zip(opt.param_groups, readers):
                group.update(settings(*key)[1])  # type: ignore[index]  # an LR scheduler's changes
            for p in live:
                entry = state.get(p.master, {})
                if p.whole:  # the piece's own tensors (the scratch's view of it has the same shape)
                    p.view.grad = grads[p.key]
                    opt.state[p.view] = dict(entry)
                    continue
                p.view.grad = grads[p.key][p.lo : p.hi]
                opt.state[p.view] = {k: v[p.lo : p.hi] if is_elementwise(v) else copy_scalar(v) for k, v in entry.items()}
            try:
                unhooked_step(opt)
                for p in live:
                    self._collect(p, opt.state[p.view], state, new.setdefault(id(p.master), {}))
                    if p.last and (entry := new.pop(id(p.master))):  # none for state-less ones (SGD)
                        state[p.master] = {**state.get(p.master, {}), **entry}
            finally:
                opt.state.clear()
                for p in live:
                    p.view.grad = None

    @staticmethod
    def _collect(part: _Part, stepped: dict[str, Any], state: dict[torch.Tensor, dict[str, Any]],
                 new: dict[str, Any]) -> None:
        """Put a stepped part's state where the piece's is: elementwise values into the piece's tensors
        (into new ones for state the piece gets at this step), one-number values into ``new``."""
        for k, v in stepped.items():
            if not is_elementwise(v):
                new[k] = v
                continue
            whole = state.get(part.master, {}).get(k)
            if not is_elementwise(whole):  # state the piece has from this step on (its first)
                if part.whole:
                    new[k] = v
                    continue
                whole = new.get(k)
                if whole is None:
                    whole = new[k] = torch.empty(part.master.numel(), dtype=v.dtype, device=v.device)
            dst = whole[part.lo : part.hi]
            if dst.data_ptr() != v.data_ptr():
                dst.copy_(v.reshape(-1))
