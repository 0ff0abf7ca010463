"""Optimizer offload with the elementwise state in files (``offload_dir``; see [Note: step backends]).

[Note: optimizer state on disk]
With ``offload_dir`` each elementwise state tensor (Adam's moments, say) lives in a plain file per
(flat group, state key) in a fresh folder of this run (``tempfile.mkdtemp``: a crashed run's
leftovers are never read back, and nothing there is a checkpoint: state dicts go through
``ZeroOptimizer.state_dict``). Only one-number state (``step``) stays in memory, in
``inner.state[piece]``. A step reads a tile of ``offload_tile_mb`` from each file, steps it with a
scratch optimizer of the user's class, and writes it back; one I/O thread reads the next tile and
writes the previous one while the host steps the current one, so host memory holds three tiles.
A tile may split a piece: each part starts from a copy of the piece's one-number state, and since
those evolve the same way in every part (the step count and what derives from it) any part's
result is the piece's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Sequence

import torch

from ....config import ZeroConfig
from ...buffers.host import HOST
from ..state import is_elementwise
from ..tiles import PieceKey, Settings, TilePart, copy_scalar, plan_tiles, step_views
from .backend import Stepped
from .grads import StepGradients
from .host import GradOf, HostTilesStep


class DiskState:
    """Elementwise optimizer state in files, one per (flat group, state key): see [Note: optimizer
    state on disk]. Offsets are in the rank's flat shard of the group."""

    def __init__(self, folder: str, rank: int, shard_numels: Sequence[int]) -> None:
        try:
            os.makedirs(folder, exist_ok=True)
            self.folder = tempfile.mkdtemp(prefix=f"zero-rank{rank}-", dir=folder)
        except OSError as err:
            raise ValueError(f"offload_dir={folder!r} is not a folder this process can write to ({err}); "
                             "pass a writable folder (on a fast local disk, an NVMe mount say).") from err
        self.shard_numels = list(shard_numels)
        self.files: dict[tuple[int, str], tuple[int, torch.dtype]] = {}  # (group, key) -> (fd, dtype)
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero-offload-io")
        self._finalizer = weakref.finalize(self, DiskState._remove, self.files, self.folder, self._io)

    @staticmethod
    def _remove(files: dict, folder: str, io: ThreadPoolExecutor) -> None:
        io.shutdown(wait=True)
        for fd, _ in files.values():
            os.close(fd)
        files.clear()
        shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        """Delete the files (also done when this object is collected, or at exit)."""
        self._finalizer()

    def nbytes(self) -> int:
        """Bytes the files take (their full size)."""
        return sum(self.shard_numels[gi] * dtype.itemsize for (gi, _), (_, dtype) in self.files.items())

    def has(self, group: int, key: str) -> bool:
        return (group, key) in self.files

    def dtype(self, group: int, key: str) -> torch.dtype:
        return self.files[(group, key)][1]

    def _fd(self, group: int, key: str, dtype: torch.dtype) -> int:
        entry = self.files.get((group, key))
        if entry is None:
            safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in key)
            path = os.path.join(self.folder, f"group{group}-{safe}.bin")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.ftruncate(fd, self.shard_numels[group] * dtype.itemsize)  # sparse until written
            entry = self.files[(group, key)] = (fd, dtype)
        if entry[1] != dtype:
            raise ValueError(f"optimizer state {key!r} of flat group {group} arrived as {dtype} after {entry[1]}: "
                             "disk offload keeps one dtype per state key and group.")
        return entry[0]

    def read(self, group: int, key: str, start: int, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out`` (contiguous, host) with elements ``[start, start + out.numel())``."""
        fd, dtype = self.files[(group, key)]
        assert out.dtype == dtype and out.is_contiguous()
        view = memoryview(out.view(torch.uint8).numpy())
        offset, done = start * dtype.itemsize, 0
        while done < len(view):  # a single call moves at most ~2 GiB
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(f"short read from the optimizer state file of {key!r} in {self.folder}")
            done += n
        return out

    def write(self, group: int, key: str, start: int, values: torch.Tensor) -> None:
        """Store ``values`` (host) as elements ``[start, start + values.numel())``."""
        fd = self._fd(group, key, values.dtype)
        view = memoryview(values.contiguous().view(torch.uint8).numpy())
        offset, done = start * values.dtype.itemsize, 0
        while done < len(view):
            done += os.pwritev(fd, [view[done:]], offset + done)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on the I/O thread (reads and writes in submission order)."""
        return self._io.submit(fn, *args)


class DiskStepper:
    """Steps the optimizer tile by tile, its elementwise state on disk: see [Note: optimizer state
    on disk]. Tile coordinates are offsets in the rank's flat shard of each group."""

    def __init__(self, disk: DiskState, tiles: list[list[TilePart]], cls: type, kwargs: dict[str, Any]) -> None:
        self.disk = disk
        self.tiles = tiles
        self.cls = cls
        self.kwargs = kwargs
        self.keys: dict[PieceKey, set[str]] = {}  # the elementwise state each piece has on disk

    # ---- the step --------------------------------------------------------------------------

    def step(self, masters: Sequence[Sequence[torch.Tensor]], offsets: Sequence[Sequence[int]],
             grads: dict[PieceKey, torch.Tensor], state: dict[torch.Tensor, dict[str, Any]], settings: Settings,
             on_tile_done: Callable[[list[TilePart]], None]) -> None:
        """One optimizer step of the pieces in ``grads`` (host gradients, shaped like the pieces).

        ``settings(gi, pi)`` gives the piece's param group (index, hyperparameters), or None for a
        piece this optimizer does not step. ``state`` is the inner optimizer's: one-number state
        per master piece, updated once every tile is done.
        """
        tiles = [[p for p in tile if (p.group, p.piece) in grads and settings(p.group, p.piece) is not None]
                 for tile in self.tiles]
        tiles = [t for t in tiles if t]
        if not tiles:
            return
        new_scalars: dict[PieceKey, dict[str, Any]] = {}
        new_keys: dict[PieceKey, set[str]] = {}
        writes: list[Future] = []
        reading = self.disk.submit(self._read, tiles[0])
        for n, parts in enumerate(tiles):
            loaded = reading.result()
            if n + 1 < len(tiles):  # read ahead while this tile steps: see [Note: optimizer state on disk]
                reading = self.disk.submit(self._read, tiles[n + 1])
            spans = self._spans(parts)
            views = []
            for part in parts:
                key = (part.group, part.piece)
                lo, hi = part.start - offsets[part.group][part.piece], part.end - offsets[part.group][part.piece]
                entry = {k: copy_scalar(v) for k, v in state.get(masters[part.group][part.piece], {}).items()}
                span_lo = spans[part.group][0]
                for k in self.keys.get(key, ()):
                    entry[k] = loaded[(part.group, k)][part.start - span_lo : part.end - span_lo]
                views.append((masters[part.group][part.piece][lo:hi], grads[key][lo:hi], settings(*key), entry))
            stepped = step_views(self.cls, self.kwargs, views)
            for part, (t, *_) in zip(parts, views):
                key = (part.group, part.piece)
                span_lo, span_hi = spans[part.group]
                for k, v in stepped[t].items():
                    if not is_elementwise(v):
                        new_scalars.setdefault(key, {})[k] = v
                        continue
                    buf = loaded.get((part.group, k))
                    if buf is None:  # state this tile's pieces did not have before the step
                        buf = loaded[(part.group, k)] = torch.zeros(span_hi - span_lo, dtype=v.dtype)
                    dst = buf[part.start - span_lo : part.end - span_lo]
                    if dst.data_ptr() != v.data_ptr():
                        dst.copy_(v.reshape(-1))
                    new_keys.setdefault(key, set()).add(k)
            for (gi, k), buf in loaded.items():
                self.disk._fd(gi, k, buf.dtype)  # files are created here, never on the I/O thread
            writes.append(self.disk.submit(self._write, loaded, {gi: lo for gi, (lo, _) in spans.items()}))
            on_tile_done(parts)
        for w in writes:
            w.result()  # errors surface here, and the next step reads what this one wrote
        for key, scalars in new_scalars.items():
            state[masters[key[0]][key[1]]] = {**state.get(masters[key[0]][key[1]], {}), **scalars}
        for key, keys in new_keys.items():
            self.keys.setdefault(key, set()).update(keys)

    @staticmethod
    def _spans(parts: Sequence[TilePart]) -> dict[int, tuple[int, int]]:
        """Per group, the range of the shard the tile covers (its parts are consecutive)."""
        spans: dict[int, tuple[int, int]] = {}
        for p in parts:
            lo, hi = spans.get(p.group, (p.start, p.end))
            spans[p.group] = (min(lo, p.start), max(hi, p.end))
        return spans

    def _read(self, parts: Sequence[TilePart]) -> dict[tuple[int, str], torch.Tensor]:
        """The tile's span of every state file its pieces have (on the I/O thread)."""
        out = {}
        for gi, (lo, hi) in self._spans(parts).items():
            keys = {k for p in parts if p.group == gi for k in self.keys.get((gi, p.piece), ())}
            for k in sorted(keys):
                out[(gi, k)] = self.disk.read(gi, k, lo, torch.empty(hi - lo, dtype=self.disk.dtype(gi, k)))
        return out

    def _write(self, loaded: dict[tuple[int, str], torch.Tensor], span_starts: dict[int, int]) -> None:
        for (gi, k), buf in loaded.items():
            self.disk.write(gi, k, span_starts[gi], buf)

    # ---- whole state, for state dicts ------------------------------------------------------

    def materialize(self, masters: Sequence[Sequence[torch.Tensor]], offsets: Sequence[Sequence[int]],
                    state: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Put every piece's elementwise state from disk into ``state`` (host memory: the whole shard)."""
        for (gi, k), (_, dtype) in list(self.disk.files.items()):
            buf = self.disk.read(gi, k, 0, torch.empty(self.disk.shard_numels[gi], dtype=dtype))
            for pi, t in enumerate(masters[gi]):
                if k in self.keys.get((gi, pi), ()):
                    off = offsets[gi][pi]
                    state[t][k] = buf[off : off + t.numel()]

    def spill(self, masters: Sequence[Sequence[torch.Tensor]], offsets: Sequence[Sequence[int]],
              state: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Move every elementwise value of ``state`` to disk, keeping one-number state in memory."""
        self.keys.clear()
        for gi, tensors in enumerate(masters):
            for pi, t in enumerate(tensors):
                entry = state.get(t)
                if not entry:
                    continue
                for k, v in list(entry.items()):
                    if is_elementwise(v):
                        self.disk.write(gi, k, offsets[gi][pi], v.detach().to(HOST).reshape(-1))
                        self.keys.setdefault((gi, pi), set()).add(k)
                        del entry[k]


class DiskStep(HostTilesStep):
    """Each tile's state read from its files, stepped by a scratch optimizer, and written back, with
    the reads and writes of the neighbouring tiles on an I/O thread. ``state_in_memory`` brings it
    all into ``stepped.state`` for state dicts, and a loaded state goes back to the files."""

    def __init__(self, stepped: Stepped, config: ZeroConfig, owner: Any) -> None:
        super().__init__(stepped, config, owner)
        assert config.offload_dir is not None
        self.disk = DiskState(config.offload_dir, stepped.rank, [g.layout.shard_numel for g in stepped.groups])
        self.stepper = DiskStepper(self.disk, plan_tiles(stepped.shard_ranges(), self.tile_numel, split_pieces=True),
                                   stepped.cls, stepped.kwargs)

    def step_tiles(self, grad_of: GradOf, grads: StepGradients) -> None:
        s = self.stepped
        self.stepper.step(s.tensors, s.offsets(), grad_of, s.state, s.settings_of(), self.written)

    @contextlib.contextmanager
    def state_in_memory(self, decoded: bool = True) -> Iterator[None]:
        s = self.stepped
        offsets = s.offsets()
        self.stepper.materialize(s.tensors, offsets, s.state)
        try:
            yield
        finally:
            self.stepper.spill(s.tensors, offsets, s.state)

    def state_loaded(self) -> None:
        super().state_loaded()
        self.stepper.spill(self.stepped.tensors, self.stepped.offsets(), self.stepped.state)

    def disk_bytes(self) -> int:
        return self.disk.nbytes()

    def close(self) -> None:
        self.disk.close()
