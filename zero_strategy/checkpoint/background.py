"""Saving a sharded checkpoint in the background, while training goes on (``async_save=True``).

[Note: saving in the background]
A save has two parts. The foreground part, on the training thread, is what must see the model as it
is at the save: rank 0 makes the partial directory (see [Note: atomic save] in checkpoint/store.py), and every
rank copies its pieces of the weights, masters and optimizer state into host buffers (hashing them
as it copies, see [Note: checksums]) and takes what the index needs from the module and the
optimizers (their keys, param groups, the front end's state, deep-copied). Then ``save_checkpoint``
returns and training goes on. The background part, on one writer thread per rank, writes the rank
file, lets the ranks agree that every file was written, and has rank 0 write trainer_state.pt and
index.json and swap the directory into place: the same steps as a synchronous save, in the same
order, so a process killed at any point leaves the previous checkpoint whole and no directory that
could be taken for a checkpoint.

- The agreement runs over a gloo process group of its own, made once (a collective, at the first
  background save, in the foreground), never over the training group: collectives of two threads on
  one group would interleave with training's and pair up wrongly.
- The host buffers are kept from save to save and reused where a tensor has the same size and
  dtype (pinned on CUDA, so the copy from the device runs at full speed): they cost host memory,
  one rank's share of the checkpoint, which ``memory_stats()["checkpoint_buffers"]`` reports and
  ``estimate_memory(..., async_save=True)`` predicts.
- A second save waits for the first; so do the end of training (the front ends' teardown) and the
  interpreter's exit (the writer is not a daemon thread). A failed background save raises its
  ``CheckpointError``, naming the checkpoint, at the next save or at the end.
- What must wait for a save to be complete waits: ``after_commit`` runs a callback once the pending
  save has committed, and never if it failed. The Trainer's strategy removes the checkpoints
  ModelCheckpoint no longer keeps that way, so the newest complete checkpoint is never removed
  before its successor is complete.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import weakref
from pathlib import Path
from typing import Callable, Optional, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ..engine.comm.collectives import Collectives
from .store import CheckpointError


class Snapshot(Protocol):
    """A save whose foreground part is done (sharded.py's ``_Snapshot``; a Protocol, so that this module
    needs no import of sharded.py, which imports it)."""

    path: Path

    def write(self, comm: Collectives) -> None: ...


log = logging.getLogger(__name__)


class BackgroundSaver:
    """One front end's background checkpoint writer (see [Note: saving in the background])."""

    def __init__(self, module: Optional[nn.Module] = None) -> None:
        """``module``: the model whose checkpoints this writes, for ``memory_stats(module)``."""
        self.buffers: dict[str, torch.Tensor] = {}  # part key -> host buffer, reused from save to save
        self._thread: Optional[threading.Thread] = None
        self._path = ""
        self._error: Optional[BaseException] = None
        self._after_commit: list[Callable[[], None]] = []
        self._side: Optional[Collectives] = None
        self._lock = threading.Lock()  # guards _running and _after_commit between the two threads
        self._running = False
        _LIVE.add(self)
        if module is not None:
            _BY_MODULE[module] = self

    # ---- the save --------------------------------------------------------------------------

    def start(self, snapshot: Snapshot, comm: Collectives) -> None:
        """Write ``snapshot`` on the writer thread; ``comm`` is the training group, whose ranks agree
        over a group of their own (made now, once: a collective)."""
        self.wait()
        side = self._side_group(comm)
        self._path, self._running = str(snapshot.path), True
        self._thread = threading.Thread(target=self._write, args=(snapshot, side), name="zero-checkpoint-writer")
        self._thread.start()

    def _write(self, snapshot: Snapshot, side: Collectives) -> None:
        try:
            snapshot.write(side)
        except BaseException as err:  # raised to the training thread at the next save or the end
            self._error = err
            with self._lock:
                dropped, self._after_commit, self._running = self._after_commit, [], False
            log.error("the background save of %s failed: %s%s", snapshot.path, err,
                      f" ({len(dropped)} older checkpoint(s) kept, not removed)" if dropped else "")
            return
        with self._lock:
            callbacks, self._after_commit, self._running = self._after_commit, [], False
        for callback in callbacks:
            try:
                callback()
            except Exception as err:  # noqa: BLE001 - a removal that fails must not hide the next one's
                log.warning("after the background save of %s: %s", snapshot.path, err)

    def _side_group(self, comm: Collectives) -> Collectives:
        if comm.world_size == 1:
            return comm
        if self._side is None:
            if comm.world_size != dist.get_world_size():
                raise ValueError(f"async_save needs the engine's process group to be the whole world ({comm.world_size} "
                                 f"of {dist.get_world_size()} ranks here), since the writer's own group is made "
                                 "from it; save synchronously (async_save=False).")
            self._side = Collectives(dist.new_group(backend="gloo"))
        return self._side

    # ---- waiting ---------------------------------------------------------------------------

    @property
    def pending(self) -> bool:
        """Whether a save is being written now."""
        return self._running

    def wait(self) -> None:
        """Wait for the save in flight, if any; raise what it failed with (once)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"the background save of the checkpoint {self._path} failed: {error}") from error

    def after_commit(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the save in flight has committed (now, if none is); never if it fails."""
        with self._lock:
            if self._running:
                self._after_commit.append(callback)
                return
        if self._error is None:
            callback()
        else:  # the last save failed (its error not raised yet): what it would have replaced stays
            log.warning("the last background save (%s) failed, so what was to wait for it is not done (an older "
                        "checkpoint is kept, not removed)", self._path)

    def buffer_bytes(self) -> int:
        """Host bytes the buffers hold (kept between saves)."""
        return sum(t.numel() * t.element_size() for t in self.buffers.values())

    def close(self) -> None:
        """Wait for the last save, raise its error, and free the buffers."""
        try:
            self.wait()
        finally:
            self.buffers.clear()


_LIVE: "weakref.WeakSet[BackgroundSaver]" = weakref.WeakSet()
_BY_MODULE: "weakref.WeakKeyDictionary[nn.Module, BackgroundSaver]" = weakref.WeakKeyDictionary()


def checkpoint_buffer_bytes(module: nn.Module) -> int:
    """Host bytes held between saves by the background saver of ``module`` (0 without one)."""
    saver = _BY_MODULE.get(module)
    return saver.buffer_bytes() if saver is not None else 0


@atexit.register
def _report_unraised_errors() -> None:
    """At exit (after the writer threads finished): a failed save nobody waited for is not silent."""
    for saver in list(_LIVE):
        if saver._error is not None:
            print(f"zero_strategy: the background save of the checkpoint {saver._path} failed and nothing waited for "
                  f"it: {saver._error}", file=sys.stderr)
