"""The sharded optimizer: the user's optimizer class re-created over this rank's pieces.

[Note: master weights]
Each rank updates only the pieces it owns (see [Note: pieces]). When the working parameters are
fp32 (or fp64), the owned pieces *are* the master weights: the inner optimizer updates the rank's
slice of the flat parameter buffer in place and one all-gather per segment brings every rank's
slices back to everyone, so no second fp32 copy exists. bf16/fp16 parameters get an fp32 copy
of the owned shard instead (see [Note: master copies] in engine/buffers/flat.py). The user's optimizer object is kept:
its
``param_groups`` list is shared with this one, so LR schedulers built on it and Lightning's LR
monitor see and change the hyperparameters that the inner optimizer uses at every step.

The step itself is the step backend's (see [Note: step backends] in engine/optim/step/backend.py), chosen
once when this is built (``choose_step_backend`` in engine/optim/step/choice.py).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator, Optional

import torch

from ...config import ZeroConfig
from ..buffers.host import HOST
from ..comm.collectives import Collectives, wait_all
from ..diagnose.breakdown import OPTIMIZER, STEP_GATHER
from ..diagnose.ranges import span
from ..grads.accumulation import LocalAccumulation
from ..grads.reducer import make_reducer
from ..grads.scaler import LossScaler
from ..params.flat_parameters import FlatParameters
from .checks import ELEMENTWISE_OPTIMIZERS, check_optimizer_supported, check_parameters, check_same_config
from .step.backend import PieceRef, StepBackend
from .step.choice import build_step_backend, build_stepped, choose_step_backend
from .step.grads import StepGradients

__all__ = ["ELEMENTWISE_OPTIMIZERS", "PieceRef", "ZeroOptimizer", "check_optimizer_supported"]


class ZeroOptimizer(torch.optim.Optimizer):
    """A torch optimizer re-created over this rank's pieces (stages 1-3), usable in a plain
    torch.distributed loop.

    Parameters must hold the same values on every rank when this is constructed (same seed, or a
    broadcast), as for DDP. After construction the trainable parameters are views of flat buffers
    (``sharder``'s: see [Note: one owner of the flat groups]); call ``backward`` as usual, then
    ``step()`` and ``zero_grad()`` on this object. ``pieces()`` lists what it steps, and
    ``step_backend`` is how (see [Note: step backends]).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: Optional[ZeroConfig] = None,
                 comm: Optional[Collectives] = None, sharder: Optional[FlatParameters] = None,
                 scaler: Optional[LossScaler] = None) -> None:
        config = config or (sharder.config if sharder is not None else ZeroConfig())
        check_optimizer_supported(optimizer, config)
        check_parameters(optimizer)
        if sharder is None:  # a plain loop: the owner of the flat groups is built over these parameters
            if config.stage == 3:
                raise ValueError("ZeRO stage 3 shards the module's parameters before the optimizer sees them: build "
                                 "sharder = shard_module(model, config) first and pass ZeroOptimizer(..., "
                                 "sharder=sharder).")
            params = [p for group in optimizer.param_groups for p in group["params"]]
            sharder = FlatParameters(params, config, comm or Collectives(collective_timeout=config.collective_timeout))
        check_same_config(config, sharder.config)
        self.config = config
        self.optim = optimizer
        self.sharder = sharder
        self.comm = sharder.comm
        self.groups = sharder.groups_of(optimizer)  # see [Note: one owner of the flat groups]
        self._device = self.groups[0].device if self.groups else torch.device("cpu")  # where collectives run
        cls = type(optimizer)
        backend = choose_step_backend(config, cls, self._device)  # see [Note: step backends]
        self._stepped = build_stepped(backend, optimizer, self.groups, self._device, self.comm.rank)
        self.inner = self._stepped.inner
        super().__init__([{"params": g["params"]} for g in optimizer.param_groups], optimizer.defaults)
        self.param_groups = optimizer.param_groups  # shared: see [Note: master weights]
        self.scaler = scaler
        self._step = StepGradients()  # see [Note: state behind LightningOptimizer] in engine/optim/step/grads.py
        self.steps_begun = 0  # reduce_gradients calls that reduced (see [Note: the step's tally] in
                              # engine/diagnose/tally.py)
        self.step_backend: StepBackend = build_step_backend(backend, self._stepped, config, weakref.proxy(self))
        weakref.finalize(self, self.step_backend.close)
        self.reducer = make_reducer(self.groups, config.stage, sharder.reduce_comm, sharder.position,
                                    listener=sharder if config.stage == 3 else None,
                                    host_dtypes=self._stepped.master_dtypes() if backend.on_host else None,
                                    host_listener=self.step_backend.segment_listener,
                                    local=LocalAccumulation(self.groups, config.grad_accum_dtype)
                                    if config.local_accumulation and config.stage >= 2 else None,
                                    hybrid=sharder.hybrid, replica_all_reduce=config.replica_all_reduce)
        if type(self) is ZeroOptimizer:
            self.__class__ = _named_like(cls)

    @property  # type: ignore[override]
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """The inner optimizer's state, keyed by the stepped tensors (``pieces()``), always its current
        dict (torch's load replaces it). See ``piece_state`` for one piece's. Stepped whole (see [Note:
        whole-parameter step] in engine/optim/step/whole.py): the owned parameters' state, keyed by
        their whole tensors."""
        backend = getattr(self, "step_backend", None)  # torch's __init__ reads it before the backend exists
        return backend.state if backend is not None else self.inner.state

    @state.setter
    def state(self, value: dict[torch.Tensor, dict[str, Any]]) -> None:  # torch's __init__ sets an empty one
        self.inner.state = value

    def piece_state(self, ref: PieceRef) -> dict[str, Any]:
        """One piece's optimizer state as the inner optimizer keeps it ({} before its first step). With
        disk offload or encoded low-precision state, whole only inside ``materialized_state``."""
        return self._stepped.state_of(ref.tensor)

    def _coming_settings(self) -> list[dict[str, Any]]:
        """Each param group's hyperparameters as the next step sets them in the inner optimizer: the
        user's (an LR scheduler's changes), except those the step backend sets (the host kernel choice)."""
        kept = ("params", *self.step_backend.own_settings)
        return [{**{k: v for k, v in inner.items() if k != "params"},
                 **{k: v for k, v in user.items() if k not in kept}}
                for user, inner in zip(self.param_groups, self.inner.param_groups)]

    def _grad_factor(self) -> float:
        """What the reduced gradients are multiplied by before the step (1 / loss scale)."""
        return 1.0 / self.scaler.scale if self.scaler is not None else 1.0

    def pieces(self) -> Iterator[PieceRef]:
        """Every piece this rank steps, with the tensor the inner optimizer updates for it (its state:
        ``piece_state(ref)``)."""
        return self._stepped.pieces()

    # ---- deferred reductions: [Note: local accumulation] in engine/grads/accumulation.py, and
    # ---- [Note: hybrid sharding] in engine/comm/topology.py

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Backward passes inside add their gradients into this rank's local buffers; the next one
        outside (or the step) reduces them all at once. Only with ``local_accumulation`` at stages 2-3;
        with hybrid sharding (stages 2-3, ``replica_all_reduce="boundary"``) they are reduced within
        the shard group as usual and only the all-reduce across the replicas waits for the next one.
        Otherwise nothing changes (stage 1 reduces at the step anyway; stages 2-3 without it reduce
        every backward's gradients into the shard)."""
        deferral = getattr(self.reducer, "deferral", None)
        return deferral.no_sync() if deferral is not None else contextlib.nullcontext()

    def defer_reduction_when(self, predicate: Optional[Callable[[], bool]]) -> None:
        """Where ``no_sync`` defers: ask ``predicate`` at each backward's first gradient whether that
        backward defers its reduction (``initialize``'s engine: off its accumulation boundary)."""
        deferral = getattr(self.reducer, "deferral", None)
        if deferral is not None:
            deferral.defer_when = predicate

    # ---- the step --------------------------------------------------------------------------

    def reduce_gradients(self) -> None:
        """Average gradients across ranks and make the master gradients: one per piece whose
        parameter got a gradient on some rank, divided by the loss scale (at once, or in the fused
        step: see [Note: the fused mixed-precision step]); with a loss scaler, also learn whether any
        rank overflowed.

        Runs before gradient clipping and the step; idempotent until ``zero_grad``.
        """
        if self._step.ready:
            return
        self.comm.breakdown.enter(OPTIMIZER)  # the step's phase: see [Note: the step breakdown]
        self.reducer.reduce()
        self.steps_begun += 1
        received = self.reducer.received_anywhere(self.steps_begun, self.sharder.guard)
        self.step_backend.gradients_reduced()
        pairs, where = [], []
        for ref in self.pieces():
            if received[ref.group_index][ref.piece.param]:
                pairs.append((ref.tensor, self.reducer.piece_grad(ref.group_index, ref.piece)))
                where.append((ref.group_index, ref.index))
        self._step.set(pairs, where, self.step_backend.defers_gradients,
                       self.scaler.scale if self.scaler is not None else None)
        if self.scaler is not None:
            self._step.find_overflow(self.comm, self._device)

    def piece_grads(self) -> list[torch.Tensor]:
        """The master gradients (see reduce_gradients), unscaled and clipped, in the masters' dtype."""
        self.reduce_gradients()
        self._step.materialize()
        self._step.altered = True  # the caller may change them
        return self._step.grads

    @property
    def overflowed(self) -> bool:
        """A non-finite gradient on some rank: the step is skipped (valid after reduce_gradients)."""
        return self._step.overflow

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with span(lambda: "zero/step"):  # see [Note: profiler ranges] in engine/diagnose/ranges.py
            self._step_now()
        return loss

    def _step_now(self) -> None:
        self.comm.breakdown.enter(OPTIMIZER)
        self.reduce_gradients()
        if self._step.overflow:  # parameters and optimizer state stay as they are
            self.step_backend.discard()
            self.scaler.update(overflow=True)
            self.comm.end_step()
            return
        for tensors in self._stepped.tensors:
            for t in tensors:
                t.grad = None
        for inner_group, settings in zip(self.inner.param_groups, self._coming_settings()):
            inner_group.update(settings)
        with span(lambda: "zero/update"):
            self.step_backend.update(self._step)  # see [Note: step backends]
        if self.scaler is not None:
            self.scaler.update(overflow=False)
        self._all_gather_params()
        self.sharder.shards_written(self.groups)  # a unit held across the step holds the new weights
        self.comm.end_step()  # the step's bytes become comm_stats()
        self.optim._opt_called = True  # type: ignore[attr-defined]  # LR schedulers check this flag,
        self._opt_called = True  # on whichever optimizer they were pointed at

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # what LR schedulers look for on step

    def _all_gather_params(self) -> None:
        with span(lambda: "zero/all-gather updated parameters"):
            wait_all([
                self.comm.all_gather(g.segment_of(g.buffer, seg), g.own_shard_of(g.buffer, seg),
                                     lambda: "all-gather of the updated parameters after the step")
                for g in self.groups if g.resident for seg in g.segments
            ], STEP_GATHER)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.step_backend.discard()
        self.reducer.zero_grad()
        self._step.reset()
        for tensors in self._stepped.tensors:
            for t in tensors:
                t.grad = None
        for group in self.param_groups:  # frozen parameters, as torch would
            for p in group["params"]:
                if not p.requires_grad and p.grad is not None:
                    p.grad = None if set_to_none else p.grad.zero_()

    # ---- gradient clipping over all shards -------------------------------------------------

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale gradients so their global norm (over every rank's shard) is at most ``max_norm``.

        Returns the total norm before clipping, as ``torch.nn.utils.clip_grad_norm_`` does.
        """
        self.reduce_gradients()
        return self._step.clip_norm(float(max_norm), float(norm_type), self.comm, self._device)

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        grads = self.piece_grads()
        for g in grads:
            g.clamp_(-clip_value, clip_value)

    # ---- state dict: the unsharded layout of the user's optimizer ---------------------------

    @contextlib.contextmanager
    def materialized_state(self, decoded: bool = True) -> Iterator[None]:
        """Inside the block ``state[piece]`` holds every piece's whole state, as without disk
        offload (read from the files into host memory: this rank's whole shard of it); after it, the
        state goes back to the files, with any change made inside. Without disk offload: nothing to do.
        For code that reads ``state`` directly (checkpoints): see [Note: offloaded step] in engine/optim/step/host.py.
        Encoded low-precision state is decoded to fp32 inside, unless ``decoded=False`` (then it is
        only in ``step_backend.stored_state``)."""
        with self.step_backend.state_in_memory(decoded):
            yield

    def state_dict(self) -> dict[str, Any]:
        return self.step_backend.full_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step_backend.discard()
        self.step_backend.load_full_state_dict(self, state_dict)

    def comm_stats(self, times: bool = False) -> dict[str, float]:
        """Bytes this rank sent since the step before the last one ended, through the last one's end
        (its forward, backward and step), by collective kind and by link (see [Note: bytes sent] in
        engine/comm/volume.py). With several optimizers, each step closes the count. ``times``: also the
        seconds waited for them (see ``Collectives.comm_stats``)."""
        return self.comm.comm_stats(times)

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Tensors this engine keeps alive, by kind (the inner optimizer's state aside), under
        ``host`` those of them (and of the state) that live in host memory because of offload, and
        under ``workspace`` the staging buffers kept for the next backward; ``master_params`` includes the
        shadows of ``offload_overlap``, and ``pending_states`` its second copy of the optimizer state;
        ``stored_states`` is the low-precision step's encoded state."""
        held = self.step_backend.held()
        masters = [g.master_shard for g in self.groups if g.master_shard is not None] + held["master_params"]
        pending = held["pending_states"]  # optimizer state of the overlapped step, not yet committed
        host: list[torch.Tensor] = []
        if self.step_backend.on_host:
            state = [v for entry in self.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]
            host = [*self.reducer.host_tensors(), *(m for m in masters if m.device == HOST), *state, *pending,
                    *held.get("stored_states", [])]
        return {"grads": self.reducer.held_tensors(),  # fp32 weights are their own master: no copy
                "master_params": masters, "pending_states": pending, "host": host,
                "stored_states": held.get("stored_states", []),  # low-precision state (engine/optim/step/lowp.py)
                "workspace": self.reducer.workspace_tensors()}

    def disk_bytes(self) -> int:
        """Bytes of optimizer state in ``offload_dir`` files (0 without disk offload)."""
        return self.step_backend.disk_bytes()

    def offload_overlap_stats(self) -> dict[str, int]:
        """With ``offload_overlap``, in pieces since construction: the updates made during backward that
        the steps committed (``swapped``: of them, those committed without a copy), computed again (a
        segment reduced again) and dropped (see [Note: the overlapped host step] in engine/optim/step/overlap.py); empty
        without it."""
        return self.step_backend.stats()

    def close(self) -> None:
        """Delete the disk-offload files and stop the overlapped step's worker now (otherwise when this
        object is collected, or at exit)."""
        self.step_backend.close()

    def remove_hooks(self) -> None:
        self.reducer.remove_hooks()


def _named_like(cls: type) -> type:
    """ZeroOptimizer under the name of the optimizer class it shards.

    [Note: optimizer names]
    Code that names an optimizer by its class (Lightning's LearningRateMonitor logs ``lr-AdamW``,
    progress bars, users' callbacks) should see the user's optimizer, not the wrapper. So each
    ZeroOptimizer becomes an instance of a subclass named after the inner class (``AdamW``); it is
    still a ZeroOptimizer in every other respect, and is registered in this module under a unique
    name so that pickle finds it.
    """
    qualname = f"_Zero{cls.__name__}_{cls.__module__.replace('.', '_')}"
    named = globals().get(qualname)
    if named is None:
        named = type(cls.__name__, (ZeroOptimizer,), {"__module__": __name__, "__qualname__": qualname,
                                                      "__doc__": f"ZeroOptimizer sharding a {cls.__name__}."})
        globals()[qualname] = named
    return named
