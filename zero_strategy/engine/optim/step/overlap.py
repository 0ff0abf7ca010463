"""Optimizer offload's host step, started during backward (``offload_overlap``).

[Note: the overlapped host step]
Without it, the host steps the whole shard after backward, while the device waits. With it, each
segment's host update starts on a worker thread as soon as the segment's reduced gradient has
reached the host (stages 2 and 3 reduce segments during backward: see [Note: gradients to the host]
in engine/grads/reducer.py), and the step itself only commits the results. The update is speculative: the
decisions that may change it come later, so it is computed aside, where nothing else reads it,
and committed only where it is the update the step would have made.

- *Aside*: the worker steps a shadow of each master piece and a copy of its state (into the
  tensors the state had before the last commit, once there are such), with a scratch optimizer of
  the user's class (``step_views``). The masters, the optimizer state and the device weights stay
  as they are until the commit, so a forward, a gather (the host shard is the parameters at stage 3
  with ``offload_params``), a checkpoint or a discarded step see the values before the step.
- *Commit*: at ``step()``, a piece's result is taken when its gradient is the one it was computed
  from, its param group's hyperparameters are the ones the step uses, the loss scale is the same,
  and nothing scaled or clipped the gradients since (a clip coefficient of exactly 1 changes
  nothing, so it does not count). Where the taken pieces hold most of a group whose master is a
  copy of its own (offload's host master), taking them costs no copy: the group's shadow is a
  second master shard, and the two trade places (``swap``); the master pieces are therefore built
  as tensors of their own, not views (``set_`` moves them; a view's ``_base`` would still name the
  old buffer). Elsewhere (the parameter shard itself at stage 3 with ``offload_params``, or a group
  mostly not taken) it is a copy of the shadow into the master. The new state takes the place of
  the old, so the piece's optimizer state holds other tensors after each step (a state dict kept from
  an earlier step sees them overwritten, as torch's in-place update would). Every other piece
  steps at ``step()`` as without the overlap. Either way the values are those of the
  non-overlapped step, bit for bit (``tests/test_offload_overlap.py``).
- *Redo*: a segment reduced again (gradient accumulation, a late gradient: [Note: late
  gradients]) is updated again from its new gradient, superseding the earlier result (whose
  tensors are reused, so accumulation holds one result per piece). An overflow of the loss
  scaler, ``zero_grad``, a loaded state dict, or a write of the masters outside the step (an edit
  in ``gathered_parameters``, loaded weights: ``FlatGroup.prepare_master_write``) drops every
  result. A backward that adds to gradients the step has prepared already (``clip_grad_norm_``
  between micro-batches, or no ``zero_grad`` between steps) is not updated early.

Only pieces whose parameter got a gradient on this rank are updated early (those are stepped
whatever the other ranks did); the others wait for the step, which knows whether some rank had
one. The cost is host memory, a shadow of the masters and a second copy of the state, kept from
step to step (12 bytes per parameter for Adam), and the host work of results that are dropped.
``stats`` counts, in pieces, the results committed (of them, ``swapped`` without a copy), computed
again, and dropped.
"""

from __future__ import annotations

import copy
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Collection, Optional, Sequence

import torch

from ....config import ZeroConfig
from ...buffers.flat import FlatGroup
from ...buffers.host import host_copy
from ..checks import ELEMENTWISE_OPTIMIZERS
from ..state import is_elementwise
from ..tiles import PieceKey, copy_scalar, step_views
from .backend import Stepped
from .grads import StepGradients
from .host import GradOf, HostTilesStep

GroupSettings = list[dict[str, Any]]  # per user param group, the hyperparameters of the coming step


@dataclass
class _Result:
    """One piece's update computed aside."""

    shadow: torch.Tensor  # the updated master
    state: dict[str, Any]  # its new state
    segment: tuple[int, int]
    generation: int  # of the segment's gradient it was computed from
    settings: dict[str, Any]  # the hyperparameters it used
    factor: float  # the gradient was multiplied by this (1 / loss scale)


class OverlappedHostStep:
    """Speculative host updates, per segment, on one worker thread: see [Note: the overlapped host
    step]. ``masters[group][piece]`` are the tensors the inner optimizer steps (host, 1-D), their
    state in ``state()`` (the inner optimizer's, read at submission and changed only by ``commit``);
    ``settings()`` gives each param group's hyperparameters as the coming step will set them,
    ``factor()`` what the step multiplies the reduced gradients by (1 / loss scale), or None once it
    has prepared them (a backward after ``reduce_gradients`` without ``zero_grad``: such gradients
    are not updated early), and ``grad_of(group, piece)`` the host gradient."""

    def __init__(self, groups: Sequence[FlatGroup], masters: Sequence[Sequence[torch.Tensor]],
                 user_group: Sequence[Sequence[int]], cls: type, kwargs: dict[str, Any],
                 state: Callable[[], dict[torch.Tensor, dict[str, Any]]],
                 settings: Callable[[], GroupSettings], factor: Callable[[], Optional[float]],
                 grad_of: Callable[[int, int], torch.Tensor]) -> None:
        self.groups = list(groups)
        self.masters = masters
        self.user_group = user_group
        self.cls = cls
        self.kwargs = kwargs
        self._state, self._settings, self._factor, self._grad_of = state, settings, factor, grad_of
        self._pieces_of = [[[pi for pi, piece in enumerate(g.pieces) if g.layout.param_segments[piece.param] == si]
                            for si in range(len(g.segments))] for g in self.groups]
        self._shadows: dict[PieceKey, torch.Tensor] = {}  # pieces of groups without a flat shadow
        self._flat: dict[int, torch.Tensor] = {}  # per group with a master copy: the shadow of its master shard
        self._spares: dict[tuple[int, int, str], torch.Tensor] = {}  # state tensors free for the next update
        self._generation: dict[tuple[int, int], int] = {}  # per segment, bumped at each reduction
        self._jobs: list[Future] = []
        self._results: dict[PieceKey, _Result] = {}
        self.stats = {"committed": 0, "swapped": 0, "redone": 0, "dropped": 0}  # pieces, since construction
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero-offload-step")
        self._finalizer = weakref.finalize(self, self._worker.shutdown, wait=False)
        for g in self.groups:  # an edit of the weights or a loaded checkpoint writes the masters
            g.before_master_write = self.discard

    # ---- during backward (main thread) -----------------------------------------------------

    def segment_ready(self, gi: int, si: int, received: Sequence[bool]) -> None:
        """Segment ``si`` of group ``gi`` has its reduced gradient in the host shard (or a copy to it
        queued on the current CUDA stream): update its pieces whose parameter got a gradient here."""
        if not self._finalizer.alive:  # closed
            return
        key = (gi, si)
        generation = self._generation[key] = self._generation.get(key, 0) + 1
        self._collect(done_only=True)
        for pi in self._pieces_of[gi][si]:  # an earlier update of the segment is superseded
            old = self._results.pop((gi, pi), None)
            if old is not None:
                self._keep_spares((gi, pi), old.state)
        pieces = [pi for pi in self._pieces_of[gi][si] if received[self.groups[gi].pieces[pi].param]]
        factor = self._factor()
        if not pieces or factor is None:  # None: the step's gradients are prepared already (see factor)
            return
        if generation > 1:  # reduced again in this step
            self.stats["redone"] += len(pieces)
        event = None
        if self.groups[gi].device.type == "cuda":
            event = torch.cuda.Event()
            event.record()  # after the copy to the host shard
        state = self._state()
        settings = copy.deepcopy(self._settings())  # as they are now: a scheduler may change a tensor in place
        work = []
        for pi in pieces:
            master = self.masters[gi][pi]
            shadow = self._shadow_of(gi, pi)
            setting = settings[self.user_group[gi][pi]]
            entry = dict(state.get(master, {}))
            spares = {k: self._spares.pop((gi, pi, k), None) for k, v in entry.items() if is_elementwise(v)}
            work.append((pi, master, shadow, entry, spares, setting))
        self._jobs.append(self._worker.submit(self._update, key, generation, work, factor, event))

    def _shadow_of(self, gi: int, pi: int) -> torch.Tensor:
        """Where the piece's update is computed: its part of the group's flat shadow (see ``swap``), or
        a tensor of its own where the master is the parameter shard (stage 3 with offload_params)."""
        g = self.groups[gi]
        if g.has_master_copy:
            assert g.master_shard is not None
            flat = self._flat.get(gi)
            if flat is None:  # a copy, so that the padding between pieces is the master's
                flat = self._flat[gi] = host_copy(g.master_shard, g.master_shard.dtype, g.device)
            return FlatGroup.shard_slice(flat, g.pieces[pi])
        shadow = self._shadows.get((gi, pi))
        if shadow is None:
            shadow = self._shadows[(gi, pi)] = torch.empty_like(self.masters[gi][pi])
        return shadow

    def _update(self, segment: tuple[int, int], generation: int, work: list, factor: float,
                event: Optional[torch.cuda.Event]) -> dict[PieceKey, _Result]:
        """The worker's part: the pieces' update into their shadows and fresh state."""
        gi = segment[0]
        if self._generation.get(segment) != generation:  # superseded before it started: hand the spares back
            return {(gi, pi): _Result(shadow, {k: v for k, v in spares.items() if v is not None}, segment, generation,
                                      setting, factor) for pi, _, shadow, _, spares, setting in work}
        if event is not None:
            event.synchronize()
        with torch.no_grad():
            views = []
            for pi, master, shadow, entry, spares, setting in work:
                shadow.copy_(master)
                fresh = {k: _copy_into(spares.get(k), v) if is_elementwise(v) else copy_scalar(v)
                         for k, v in entry.items()}
                grad = self._grad_of(gi, pi)
                if factor != 1.0:
                    grad = grad * factor  # as the step's in-place unscale computes it
                views.append((shadow, grad, (self.user_group[gi][pi], setting), fresh))
            stepped = step_views(self.cls, self.kwargs, views)
        return {(gi, pi): _Result(shadow, stepped.get(shadow, {}), segment, generation, setting, factor)
                for pi, _, shadow, _, _, setting in work}

    # ---- at the step (main thread) ---------------------------------------------------------

    def wait(self) -> None:
        """Let every submitted update finish (before anything writes the host gradients); errors of
        the worker surface here."""
        self._collect(done_only=False)

    def _collect(self, done_only: bool) -> None:
        """Take the results of the finished updates (of all, waiting, unless ``done_only``); a superseded
        one's state tensors become spares, so accumulation holds one result per piece."""
        running = []
        for job in self._jobs:
            if done_only and not job.done():
                running.append(job)
                continue
            for key, result in job.result().items():
                if result.generation == self._generation.get(result.segment):
                    self._results[key] = result
                else:
                    self._keep_spares(key, result.state)
        self._jobs = running

    def take(self, settings: Callable[[int, int], tuple[int, dict[str, Any]]], factor: float,
             altered: bool) -> dict[PieceKey, _Result]:
        """The results the step may commit (see [Note: the overlapped host step]); the rest are
        dropped. ``settings(group, piece)`` gives the hyperparameters the step uses; ``altered``: the
        gradients were changed since their reduction (clipped, say)."""
        self.wait()
        results, self._results = self._results, {}
        self._generation.clear()
        valid = {} if altered else {key: r for key, r in results.items()
                                    if r.factor == factor and same_settings(r.settings, settings(*key)[1])}
        self._drop({key: r for key, r in results.items() if key not in valid})
        return valid

    def swap(self, taken: dict[PieceKey, _Result], stepped: Collection[PieceKey],
             state: dict[torch.Tensor, dict[str, Any]]) -> set[PieceKey]:
        """Commit the taken pieces of a group with a flat shadow without copying them, where they
        hold most of its elements: the shadow becomes the master shard (the group's other pieces
        copied over first, to be stepped there by the step, or kept if it does not step them), and
        the old master shard the next shadow. The master pieces, the inner optimizer's tensors, are
        pointed at it in place (``set_``), so they stay the keys of its state. Returns the pieces
        committed; ``stepped``: those the step updates."""
        done: set[PieceKey] = set()
        for gi, flat in list(self._flat.items()):
            g = self.groups[gi]
            keys = {(gi, pi) for pi in range(len(g.pieces)) if (gi, pi) in taken and (gi, pi) in stepped}
            moved = sum(g.pieces[pi].numel for _, pi in keys)
            if not keys or 2 * moved < sum(piece.numel for piece in g.pieces):  # copying them costs less
                continue
            for pi, piece in enumerate(g.pieces):
                if (gi, pi) not in keys:  # its value as it is now, for the step or to carry over
                    FlatGroup.shard_slice(flat, piece).copy_(self.masters[gi][pi])
            self._flat[gi], g.master_shard = g.master_shard, flat
            for pi, piece in enumerate(g.pieces):
                self.masters[gi][pi].set_(flat.untyped_storage(), flat.storage_offset() + piece.shard_offset,
                                          (piece.numel,), (1,))
            for key in keys:
                self._install(key, taken[key], state)
                done.add(key)
        self.stats["swapped"] += len(done)
        return done

    def commit(self, key: PieceKey, result: _Result, state: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Make a taken result the piece's master and state (a copy: see ``swap`` for whole groups)."""
        self.masters[key[0]][key[1]].copy_(result.shadow)
        self._install(key, result, state)

    def _install(self, key: PieceKey, result: _Result, state: dict[torch.Tensor, dict[str, Any]]) -> None:
        master = self.masters[key[0]][key[1]]
        if result.state:
            old = state.get(master, {})
            state[master] = {**old, **result.state}
            self._keep_spares(key, {k: v for k, v in old.items() if v is not result.state.get(k)})
        self.stats["committed"] += 1

    def discard(self) -> None:
        """Drop every result (the step is skipped, or the gradients or the state are replaced)."""
        self.wait()
        results, self._results = self._results, {}
        self._drop(results)
        self._generation.clear()

    def _drop(self, results: dict[PieceKey, _Result]) -> None:
        """Results not committed: their state tensors become spares."""
        for key, result in results.items():
            self._keep_spares(key, result.state)
        self.stats["dropped"] += len(results)

    def _keep_spares(self, key: PieceKey, entry: dict[str, Any]) -> None:
        """State tensors nothing uses any more: the next update of the piece writes into them."""
        for k, v in entry.items():
            if is_elementwise(v) and isinstance(v, torch.Tensor):
                self._spares[(*key, k)] = v

    def shadows(self) -> list[torch.Tensor]:
        """The masters' shadows (host memory kept from step to step)."""
        return [*self._shadows.values(), *self._flat.values()]

    def extra_state(self) -> list[torch.Tensor]:
        """The second copy of the optimizer state: spare tensors, and state computed aside and not yet
        committed (between a backward and its step)."""
        self.wait()  # the state held by updates in flight too
        pending = [v for r in self._results.values() for v in r.state.values() if is_elementwise(v)]
        return [*self._spares.values(), *pending]

    def close(self) -> None:
        """Stop the worker and free the shadows (also when the optimizer is collected: the gradient
        hooks may keep this object alive longer)."""
        self._finalizer()
        for g in self.groups:
            if g.before_master_write == self.discard:
                g.before_master_write = None
        self._jobs.clear()
        self._results.clear()
        self._shadows.clear()
        self._flat.clear()
        self._spares.clear()


def _copy_into(spare: Optional[torch.Tensor], value: torch.Tensor) -> torch.Tensor:
    """A copy of ``value``, in ``spare`` where it fits."""
    if spare is None or spare.shape != value.shape or spare.dtype != value.dtype or spare.device != value.device:
        return value.clone()
    return spare.copy_(value)


def same_settings(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two param groups' hyperparameters are the same values (tensors compared by value)."""
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)


def _same(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
                and x.dtype == y.dtype and bool(torch.equal(x.cpu(), y.cpu())))
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
        return type(x) is type(y) and len(x) == len(y) and all(_same(u, v) for u, v in zip(x, y))
    try:
        return type(x) is type(y) and bool(x == y)
    except Exception:  # values without a plain equality
        return False


class OverlappedStep(HostTilesStep):
    """The host step, taking the updates its reducer's segments started during backward where they
    are the step's own (``early``, told by the reducer: ``segment_listener``); the others step as
    ``HostTilesStep`` steps them."""

    def __init__(self, stepped: Stepped, config: ZeroConfig, owner: Any) -> None:
        cls = stepped.cls
        if cls not in ELEMENTWISE_OPTIMIZERS:
            raise ValueError(
                f"offload_overlap=True computes the update with scratch optimizers of the user's class, which is "
                f"verified only for torch's own {', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}; "
                f"{cls.__module__}.{cls.__qualname__} is not one of them (a subclass may keep state of its own). "
                "Set offload_overlap=False.")
        super().__init__(stepped, config, owner)
        self.early = OverlappedHostStep(  # owner: a weak proxy (the gradient hooks hold this object)
            stepped.groups, stepped.tensors, stepped.user_group, cls, stepped.kwargs, state=lambda: stepped.state,
            settings=lambda: owner._coming_settings(),
            factor=lambda: None if owner._step.ready else owner._grad_factor(),
            grad_of=lambda gi, pi: owner.reducer.piece_grad(gi, stepped.groups[gi].pieces[pi]))
        self._owner = owner

    @staticmethod
    def pieces_of(group: FlatGroup) -> list[torch.Tensor]:
        """Not views: the overlap points them at another buffer (``OverlappedHostStep.swap``)."""
        return [torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape,
                                                                    t.stride())
                for t in HostTilesStep.pieces_of(group)]

    @property
    def segment_listener(self) -> Optional[OverlappedHostStep]:
        return self.early

    def gradients_reduced(self) -> None:
        self.early.wait()  # its reads of the host gradients end before anything scales them
        super().gradients_reduced()

    def computed_ahead(self, grad_of: GradOf, grads: StepGradients) -> tuple[dict[PieceKey, Any], Collection[PieceKey]]:
        taken = self.early.take(self.stepped.settings_of(), self._owner._grad_factor(), grads.changed)
        return taken, self.early.swap(taken, grad_of.keys(), self.stepped.state)

    def commit(self, key: PieceKey, result: Any) -> None:
        self.early.commit(key, result, self.stepped.state)

    def discard(self) -> None:
        self.early.discard()

    def held(self) -> dict[str, list[torch.Tensor]]:
        return {"master_params": self.early.shadows(), "pending_states": self.early.extra_state()}

    def stats(self) -> dict[str, int]:
        return dict(self.early.stats)

    def close(self) -> None:
        self.early.close()
