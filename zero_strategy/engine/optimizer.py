"""The sharded optimizer: the user's optimizer class re-created over this rank's pieces.

[Note: master weights]
Each rank updates only the pieces it owns (see [Note: pieces]). When the working parameters are
fp32 (or fp64), the owned pieces *are* the master weights: the inner optimizer updates the rank's
slice of the flat parameter buffer in place and one all-gather per segment brings every rank's
slices back to everyone, so no second fp32 copy exists. bf16/fp16 parameters get an fp32 copy
of the owned shard instead (see [Note: master copies] in flat.py). The user's optimizer object is kept: its
``param_groups`` list is shared with this one, so LR schedulers built on it and Lightning's LR
monitor see and change the hyperparameters that the inner optimizer uses at every step.

[Note: offloaded step]
With ``offload_optimizer`` the master pieces, their gradients and the inner optimizer's state are
host tensors (see offload.py), and the inner optimizer is re-created fused (or foreach) for the
host. The step runs tile by tile, each tile's updated pieces starting their copy to the device as
the next tile steps; then the device waits for those copies and the all-gathers run as usual. With
``offload_dir`` the state of each tile comes from disk and goes back to it; ``state_dict()`` reads
it all into memory for the consolidation and ``load_state_dict()`` writes it all out again, so the
unsharded state dict is the same as without offload.

[Note: kernels in the step]
On CUDA, when CuPy imports (see zero_strategy/kernels), three passes run as fused kernels: the
overflow check of the loss scaler and the local norm for clipping (one read of every gradient,
``grad_norm_and_overflow``), and the update of Adam, AdamW and SGD (``optimizer_step``: one
launch per param group over all its pieces, each piece with its own step count, the state kept
in torch's layout in ``inner.state``). Any other optimizer, dtype or device runs torch's own
code, as on CPU, and ``ZERO_STRATEGY_KERNELS=torch`` forces that everywhere.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
import torch.distributed as dist

from .. import kernels
from ..config import ZeroConfig
from .collectives import Collectives, wait_all
from .flat import FlatGroup
from .gradients import make_reducer
from .layout import Piece
from .offload import HOST, DiskState, DiskStepper, host_optimizer_kwargs, wait_for_copies
from .overlap import OverlappedHostStep
from .parameters import ParameterSharder
from .scaler import LossScaler
from .step_grads import StepGradients
from .state import consolidate_state, shard_state
from .tiled_step import CPU_TILE_NUMEL, TiledStep, hooked_step, plan_tiles, unhooked_step

ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.Adagrad,
    torch.optim.RMSprop, torch.optim.Adadelta, torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD,
    torch.optim.Rprop,
)
"""Verified to update each element from that element's own gradient and state only."""

_NOT_SHARDABLE: dict[str, str] = {
    "LBFGS": "keeps a curvature history over the whole parameter vector and re-evaluates a closure",
    "SparseAdam": "expects sparse gradients",
    "Adafactor": "factors its second moment over the rows and columns of each parameter's shape",
    "Muon": "orthogonalises each parameter as a whole matrix",
}


def check_optimizer_supported(optimizer: torch.optim.Optimizer, config: ZeroConfig) -> None:
    """Raise if ``optimizer``'s update cannot run on a flat shard of its parameters."""
    cls = type(optimizer)
    allowed = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
    for klass in cls.__mro__:
        if klass.__name__ in _NOT_SHARDABLE:
            raise ValueError(
                f"{cls.__name__} cannot be sharded by ZeRO: it {_NOT_SHARDABLE[klass.__name__]}, so its update "
                f"is not elementwise. Use one of {allowed}, or train it with DDP."
            )
    if not issubclass(cls, ELEMENTWISE_OPTIMIZERS) and not config.allow_untested_optimizer:
        raise ValueError(
            f"{cls.__name__} has not been verified to be elementwise, which ZeRO needs (each rank updates a flat "
            f"shard). Verified: {allowed}. If its update reads nothing beyond each element's own gradient and "
            "state, pass allow_untested_optimizer=True."
        )


def _constructor_kwargs(cls: type, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The defaults that ``cls.__init__`` accepts (AdamW stores a default it does not take)."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}


def _check_parameters(optimizer: torch.optim.Optimizer) -> None:
    """Each parameter in one param group once, and only floating-point ones trainable."""
    seen: set[int] = set()
    for gi, user_group in enumerate(optimizer.param_groups):
        for p in user_group["params"]:
            if id(p) in seen:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} appears twice in the optimizer's param groups "
                    f"(again in group {gi}); list each parameter once."
                )
            seen.add(id(p))
            if p.requires_grad and not p.dtype.is_floating_point:
                raise ValueError(f"trainable parameters of dtype {p.dtype} in param group {gi}: only floating-point "
                                 "parameters can be trained; set requires_grad=False on them.")


def _check_same_config(mine: ZeroConfig, sharders: ZeroConfig) -> None:
    """The optimizer steps the sharder's groups: they must agree on what those hold."""
    fields = ("stage", "bucket_cap_mb", "master_weights", "offload_optimizer", "offload_params")
    differ = [f"{f}={getattr(mine, f)!r} here, {getattr(sharders, f)!r} in the sharder's"
              for f in fields if getattr(mine, f) != getattr(sharders, f)]
    if differ:
        raise ValueError(f"the ZeroOptimizer's config and the sharder's disagree: {'; '.join(differ)}. Build both with "
                         "the same ZeroConfig (shard_module(model, config), ZeroOptimizer(opt, config, sharder=...)).")


@dataclass(frozen=True)
class PieceRef:
    """One piece a ZeroOptimizer steps (see [Note: pieces] in layout.py)."""

    group_index: int  # into ZeroOptimizer.groups
    group: FlatGroup
    index: int  # into group.pieces
    piece: Piece
    tensor: torch.Tensor  # what the inner optimizer updates: the master, or the working weights
    param: torch.nn.Parameter
    param_group: int  # the user's param group


class ZeroOptimizer(torch.optim.Optimizer):
    """A torch optimizer re-created over this rank's pieces (stages 1-3), usable in a plain
    torch.distributed loop.

    Parameters must hold the same values on every rank when this is constructed (same seed, or a
    broadcast), as for DDP. After construction the trainable parameters are views of flat buffers
    (``sharder``'s: see [Note: one owner of the flat groups]); call ``backward`` as usual, then
    ``step()`` and ``zero_grad()`` on this object. ``pieces()`` lists what it steps.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: Optional[ZeroConfig] = None,
                 comm: Optional[Collectives] = None, sharder: Optional[ParameterSharder] = None,
                 scaler: Optional[LossScaler] = None) -> None:
        config = config or (sharder.config if sharder is not None else ZeroConfig())
        check_optimizer_supported(optimizer, config)
        _check_parameters(optimizer)
        if sharder is None:  # a plain loop: the owner of the flat groups is built over these parameters
            if config.stage == 3:
                raise ValueError("ZeRO stage 3 shards the module's parameters before the optimizer sees them: build "
                                 "sharder = shard_module(model, config) first and pass ZeroOptimizer(..., "
                                 "sharder=sharder).")
            params = [p for group in optimizer.param_groups for p in group["params"]]
            sharder = ParameterSharder(params, config, comm or Collectives(collective_timeout=config.collective_timeout))
        _check_same_config(config, sharder.config)
        self.config = config
        self.optim = optimizer
        self.sharder = sharder
        self.comm = sharder.comm
        self.groups = sharder.groups_of(optimizer)  # see [Note: one owner of the flat groups]
        self._device = self.groups[0].device if self.groups else torch.device("cpu")  # where collectives run
        self.offloaded = config.offload_optimizer
        host_dtypes = [g.master_shard.dtype for g in self.groups if g.master_shard is not None] if self.offloaded else None
        self._host_dtypes = host_dtypes or []
        self.reducer = make_reducer(self.groups, config.stage, self.comm, sharder.position,
                                    listener=sharder if config.stage == 3 else None, host_dtypes=host_dtypes)
        user_group_of = {p: gi for gi, group in enumerate(optimizer.param_groups) for p in group["params"]}
        inner_groups = [{**user_group, "params": []} for user_group in optimizer.param_groups]
        self._pieces = []  # the inner optimizer's tensor for each piece of each group
        self._user_group: list[list[int]] = []  # the param group of each piece
        for g in self.groups:
            stepped = [g.stepped(piece) for piece in g.pieces]
            if config.offload_overlap:  # not views: the overlap moves them to another buffer (overlap.py's swap)
                stepped = [torch.empty(0, dtype=t.dtype, device=t.device).set_(
                    t.untyped_storage(), t.storage_offset(), t.shape, t.stride()) for t in stepped]
            self._pieces.append(stepped)
            self._user_group.append([user_group_of[g.params[piece.param]] for piece in g.pieces])
            for t, gi in zip(self._pieces[-1], self._user_group[-1]):
                inner_groups[gi]["params"].append(t)
        kwargs = _constructor_kwargs(type(optimizer), optimizer.defaults)
        if self.offloaded:  # see [Note: offloaded step]
            kwargs = host_optimizer_kwargs(type(optimizer), kwargs, self._host_dtypes)
            inner_groups = [self._for_host(g) for g in inner_groups]
        self.inner = type(optimizer)(inner_groups, **kwargs)
        super().__init__([{"params": g["params"]} for g in optimizer.param_groups], optimizer.defaults)
        self.param_groups = optimizer.param_groups  # shared: see [Note: master weights]
        self.state = self.inner.state  # type: ignore[assignment]
        self.scaler = scaler
        self._step = StepGradients()  # see [Note: state behind LightningOptimizer] in step_grads.py
        self._tiles, self._disk = self._plan_offload(config, type(optimizer), kwargs)
        self._overlap = self._plan_overlap(config, type(optimizer), kwargs)
        self._tiled = None  # the CPU step in tiles: see [Note: the CPU step in tiles] in tiled_step.py
        if self._device.type == "cpu" and not self.offloaded and type(optimizer) in ELEMENTWISE_OPTIMIZERS:
            self._tiled = TiledStep(plan_tiles(self._shard_ranges(), CPU_TILE_NUMEL, split_pieces=True),
                                    type(optimizer), kwargs, self._pieces, self._piece_offsets())
        if type(self) is ZeroOptimizer:
            self.__class__ = _named_like(type(optimizer))

    def _for_host(self, group: dict[str, Any]) -> dict[str, Any]:
        """A param group's settings with the host step's kernel choice (fused or foreach)."""
        own = {k: group[k] for k in ("fused", "foreach", "capturable") if k in group}
        return {**group, **host_optimizer_kwargs(type(self.optim), own, self._host_dtypes)}

    def _plan_offload(self, config: ZeroConfig, cls: type, kwargs: dict[str, Any]):
        """Tiles of the host step and, with ``offload_dir``, the files of the optimizer state."""
        if not self.offloaded:
            return [], None
        tile_numel = max(1, int(config.offload_tile_mb * 2**20) // 4)  # MiB of fp32 master weights
        ranges = self._shard_ranges()
        if config.offload_dir is None:
            return plan_tiles(ranges, tile_numel, split_pieces=False), None
        disk = DiskState(config.offload_dir, self.comm.rank, [g.layout.shard_numel for g in self.groups])
        return [], DiskStepper(disk, plan_tiles(ranges, tile_numel, split_pieces=True), cls, kwargs)

    def _plan_overlap(self, config: ZeroConfig, cls: type, kwargs: dict[str, Any]) -> Optional[OverlappedHostStep]:
        """The host step started during backward (``offload_overlap``): see [Note: the overlapped host
        step] in overlap.py."""
        if not config.offload_overlap:
            return None
        if cls not in ELEMENTWISE_OPTIMIZERS:
            raise ValueError(
                f"offload_overlap=True computes the update with scratch optimizers of the user's class, which is "
                f"verified only for torch's own {', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}; "
                f"{cls.__module__}.{cls.__qualname__} is not one of them (a subclass may keep state of its own). "
                "Set offload_overlap=False.")
        me = weakref.proxy(self)  # the gradient hooks hold the overlap: it must not keep this optimizer alive
        overlap = OverlappedHostStep(
            self.groups, self._pieces, self._user_group, cls, kwargs, state=lambda: me.inner.state,
            settings=lambda: me._coming_settings(), factor=lambda: None if me._step.ready else me._grad_factor(),
            grad_of=lambda gi, pi: me.reducer.piece_grad(gi, me.groups[gi].pieces[pi]))
        self.reducer.host_listener = overlap
        weakref.finalize(self, overlap.close)
        return overlap

    def _coming_settings(self) -> list[dict[str, Any]]:
        """Each param group's hyperparameters as the next step sets them in the inner optimizer: the
        user's (an LR scheduler's changes), except the host step's kernel choice with offload."""
        kept = ("params", "fused", "foreach", "capturable") if self.offloaded else ("params",)
        return [{**{k: v for k, v in inner.items() if k != "params"},
                 **{k: v for k, v in user.items() if k not in kept}}
                for user, inner in zip(self.param_groups, self.inner.param_groups)]

    def _grad_factor(self) -> float:
        """What the reduced gradients are multiplied by before the step (1 / loss scale)."""
        return 1.0 / self.scaler.scale if self.scaler is not None else 1.0

    def _shard_ranges(self) -> list[list[tuple[int, int]]]:
        """Per group, each piece's elements ``[start, end)`` in this rank's shard."""
        return [[(p.shard_offset, p.shard_offset + p.numel) for p in g.pieces] for g in self.groups]

    def _piece_offsets(self) -> list[list[int]]:
        return [[p.shard_offset for p in g.pieces] for g in self.groups]

    def _settings_of(self) -> Callable[[int, int], tuple[int, dict[str, Any]]]:
        """A piece's param group (index, hyperparameters as the inner optimizer has them now)."""
        settings = [{k: v for k, v in g.items() if k != "params"} for g in self.inner.param_groups]

        def settings_of(gi: int, pi: int) -> tuple[int, dict[str, Any]]:
            index = self._user_group[gi][pi]
            return index, settings[index]

        return settings_of

    def pieces(self) -> Iterator[PieceRef]:
        """Every piece this rank steps, with the tensor the inner optimizer updates for it (its state
        is ``self.inner.state.get(ref.tensor, {})``; see ``materialized_state`` with disk offload)."""
        for gi, (g, tensors, user_groups) in enumerate(zip(self.groups, self._pieces, self._user_group)):
            for pi, (piece, tensor, user_group) in enumerate(zip(g.pieces, tensors, user_groups)):
                yield PieceRef(gi, g, pi, piece, tensor, g.params[piece.param], user_group)

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
        if self._overlap is not None:
            self._overlap.wait()  # its reads of the host gradients end before anything scales them
        self.reducer.reduce()
        received = self.reducer.received_anywhere()
        if self.offloaded:
            wait_for_copies(self._device)  # the gradients' copies to the host
        pairs, where = [], []
        for ref in self.pieces():
            if received[ref.group_index][ref.piece.param]:
                pairs.append((ref.tensor, self.reducer.piece_grad(ref.group_index, ref.piece)))
                where.append((ref.group_index, ref.index))
        deferred = bool(pairs) and kernels.available(pairs[0][1]) and not self.offloaded
        if not deferred:
            pairs = [(master, grad.to(master.dtype)) for master, grad in pairs]  # a copy only for a wider master
        self._step.set(pairs, where, deferred, self.scaler.scale if self.scaler is not None else None)
        if self.scaler is None:
            return
        grads = self._step.grads
        if not grads:
            bad = torch.zeros(1, dtype=torch.uint8, device=self._device)
        elif kernels.available(grads[0]):  # one fused pass on CUDA: see [Note: kernels in the step]
            bad = kernels.grad_norm_and_overflow(grads)[1].to(torch.uint8).reshape(1)
        else:
            norms = torch._foreach_norm(grads, dtype=torch.float32)  # fp32: an fp16 norm overflows by itself
            bad = (~torch.isfinite(torch.stack(norms).sum())).to(torch.uint8).reshape(1)
        bad = bad.to(self._device)  # host gradients (offload) give a host flag; every rank takes part
        self.comm.all_reduce(bad, op=dist.ReduceOp.MAX, what=lambda: "all-reduce of the overflow flag")
        self._step.overflow = bool(bad.item())

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
        self.reduce_gradients()
        if self._step.overflow:  # parameters and optimizer state stay as they are
            if self._overlap is not None:
                self._overlap.discard()
            self.scaler.update(overflow=True)
            self.comm.end_step()
            return loss
        for tensors in self._pieces:
            for t in tensors:
                t.grad = None
        for inner_group, settings in zip(self.inner.param_groups, self._coming_settings()):
            inner_group.update(settings)
        if self.offloaded:
            self._step_on_host()
        elif not self._fused_step():
            self._step.materialize()
            assert self._step.pairs is not None
            if not kernels.optimizer_step(self.inner, grads=dict(self._step.pairs)):
                self._torch_step()
            for g in self.groups:
                g.write_back()
        if self.scaler is not None:
            self.scaler.update(overflow=False)
        self._all_gather_params()
        self.sharder.shards_written(self.groups)  # a unit held across the step holds the new weights
        self.comm.end_step()  # the step's bytes become comm_stats()
        self.optim._opt_called = True  # type: ignore[attr-defined]  # LR schedulers check this flag,
        self._opt_called = True  # on whichever optimizer they were pointed at
        return loss

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # what LR schedulers look for on step

    def _fused_step(self) -> bool:
        """The update in one pass per piece (see [Note: the fused mixed-precision step]); False, having
        changed nothing, when the kernels do not take this optimizer over."""
        if not self._step.deferred:
            return False
        assert self._step.pairs is not None
        working = {ref.tensor: ref.group.weights(ref.piece) for ref in self.pieces() if ref.group.has_master_copy}
        if not kernels.optimizer_step(self.inner, grad_scale=self._step.scale, lowp_out=working,
                                      grads=dict(self._step.pairs)):
            return False
        return True

    def _torch_step(self) -> None:
        """The inner optimizer's own update of the pieces that have gradients (on CPU in tiles)."""
        assert self._step.pairs is not None
        if self._tiled is not None and not torch.compiler.is_compiling():  # dynamo takes the whole step
            grads = {where: grad.reshape(-1) for where, (_, grad) in zip(self._step.where, self._step.pairs)}
            tiled, settings = self._tiled, self._settings_of()
            hooked_step(self.inner, lambda: tiled.step(grads, self.inner.state, settings))
            return
        for master, grad in self._step.pairs:
            master.grad = grad
        self.inner.step()

    def _step_on_host(self) -> None:
        """The step on host tensors, tile by tile: see [Note: offloaded step]."""
        assert self._step.pairs is not None
        grad_of = {where: grad for where, (_, grad) in zip(self._step.where, self._step.pairs)}
        self._keep_state_on_host()

        def written(parts) -> None:  # start the copies of a stepped tile to the device
            for part in parts:
                g = self.groups[part.group]
                piece = g.pieces[part.piece]
                g.write_back_piece(piece, part.start - piece.shard_offset, part.end - piece.shard_offset)

        def tiles() -> None:  # one hooked step of the inner optimizer: see unhooked_step
            if self._disk is not None:
                self._disk.step(self._pieces, self._piece_offsets(), grad_of, self.inner.state, self._settings_of(),
                                written)
                return
            taken, swapped = {}, set()  # updates made during backward: see [Note: the overlapped host step]
            if self._overlap is not None:
                taken = self._overlap.take(self._settings_of(), self._grad_factor(), self._step.altered)
                swapped = self._overlap.swap(taken, grad_of.keys(), self.inner.state)
            for tile in self._tiles:
                live = [p for p in tile if (p.group, p.piece) in grad_of]
                if not live:
                    continue
                stepping = []
                for p in live:
                    key = (p.group, p.piece)
                    if key in swapped:
                        continue
                    if key in taken:
                        self._overlap.commit(key, taken[key], self.inner.state)  # type: ignore[union-attr]
                    else:
                        stepping.append(p)
                        self._pieces[p.group][p.piece].grad = grad_of[key]
                if stepping:
                    try:
                        unhooked_step(self.inner)
                    finally:
                        for p in stepping:
                            self._pieces[p.group][p.piece].grad = None
                written(live)

        hooked_step(self.inner, tiles)
        wait_for_copies(self._device)

    def _keep_state_on_host(self) -> None:
        """Lightning's checkpoint restore moves optimizer state to the root device; put it back."""
        for tensors in self._pieces:
            for t in tensors:
                entry = self.inner.state.get(t)
                if entry and any(isinstance(v, torch.Tensor) and v.device != t.device for v in entry.values()):
                    self.inner.state[t] = {k: v.to(t.device) if isinstance(v, torch.Tensor) else v
                                           for k, v in entry.items()}

    def _all_gather_params(self) -> None:
        wait_all([
            self.comm.all_gather(g.segment_of(g.buffer, seg), g.own_shard_of(g.buffer, seg),
                                 lambda: "all-gather of the updated parameters after the step")
            for g in self.groups if g.resident for seg in g.segments
        ])

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._overlap is not None:
            self._overlap.discard()
        self.reducer.zero_grad()
        self._step.reset()
        for tensors in self._pieces:
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
        grads = self._step.grads  # raw when the step is fused: see [Note: the fused mixed-precision step]
        device = self._device  # the collective's; offloaded gradients are on the host
        inf = float(norm_type) == float("inf")
        if grads and kernels.available(grads[0]) and float(norm_type) in (2.0, float("inf")):
            total = kernels.grad_norm_and_overflow(grads, norm_type)[0].double()  # sum of squares, or the max
        else:
            nonempty = [g for g in grads if g.numel()]  # foreach has no inf-norm of an empty tensor
            norms = (torch.stack(torch._foreach_norm(nonempty, norm_type, dtype=torch.float32)).double()
                     if nonempty else torch.zeros(1, device=device))  # fp32: raw bf16/fp16 norms round or overflow
            total = norms.max() if inf else norms.pow(norm_type).sum()
        total = self._step.norm_power_of_raw(total, float(norm_type)).to(device)
        what = lambda: "all-reduce of the gradient norm for clipping"  # noqa: E731
        if inf:
            self.comm.all_reduce(total, op=dist.ReduceOp.MAX, what=what)
        else:
            self.comm.all_reduce(total, what=what)
            total = total.pow(1.0 / norm_type)
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        if self._overlap is not None and not bool((coef == 1).all()):
            self._step.altered = True  # the updates made during backward used the unclipped gradients
        self._step.multiply(coef)
        return total.to(torch.float32)

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        grads = self.piece_grads()
        for g in grads:
            g.clamp_(-clip_value, clip_value)

    # ---- state dict: the unsharded layout of the user's optimizer ---------------------------

    @contextlib.contextmanager
    def materialized_state(self) -> Iterator[None]:
        """Inside the block ``inner.state[piece]`` holds every piece's whole state, as without disk
        offload (read from the files into host memory: this rank's whole shard of it); after it, the
        state goes back to the files, with any change made inside. Without disk offload: nothing to do.
        For code that reads ``inner.state`` directly (checkpoints): see [Note: offloaded step]."""
        if self._disk is None:
            yield
            return
        offsets = self._piece_offsets()
        self._disk.materialize(self._pieces, offsets, self.inner.state)
        try:
            yield
        finally:
            self._disk.spill(self._pieces, offsets, self.inner.state)

    def state_dict(self) -> dict[str, Any]:
        with self.materialized_state():
            return consolidate_state(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._overlap is not None:
            self._overlap.discard()
        shard_state(self, state_dict)
        self.state = self.inner.state  # type: ignore[assignment]  # torch's load gives the inner a new dict
        if self.offloaded:
            self.inner.param_groups[:] = [self._for_host(g) for g in self.inner.param_groups]
            self._keep_state_on_host()
        if self._disk is not None:
            self._disk.spill(self._pieces, self._piece_offsets(), self.inner.state)

    def comm_stats(self) -> dict[str, int]:
        """Bytes this rank sent since the step before the last one ended, through the last one's end
        (its forward, backward and step), by collective kind and by link (see [Note: bytes sent] in
        engine/comm_volume.py). With several optimizers, each step closes the count."""
        return self.comm.comm_stats()

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Tensors this engine keeps alive, by kind (the inner optimizer's state aside), under
        ``host`` those of them (and of the state) that live in host memory because of offload, and
        under ``workspace`` the staging buffers kept for the next backward; ``master_params`` includes the
        shadows of ``offload_overlap``, and ``pending_states`` its second copy of the optimizer state."""
        masters = [g.master_shard for g in self.groups if g.master_shard is not None]
        pending: list[torch.Tensor] = []  # optimizer state of the overlapped step, not yet committed
        if self._overlap is not None:
            masters += self._overlap.shadows()
            pending = self._overlap.extra_state()
        host: list[torch.Tensor] = []
        if self.offloaded:
            state = [v for entry in self.inner.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]
            host = [*self.reducer.host_tensors(), *(m for m in masters if m.device == HOST), *state, *pending]
        return {"grads": self.reducer.held_tensors(),  # fp32 weights are their own master: no copy
                "master_params": masters, "pending_states": pending, "host": host,
                "workspace": self.reducer.workspace_tensors()}

    def disk_bytes(self) -> int:
        """Bytes of optimizer state in ``offload_dir`` files (0 without disk offload)."""
        return self._disk.disk.nbytes() if self._disk is not None else 0

    def offload_overlap_stats(self) -> dict[str, int]:
        """With ``offload_overlap``, in pieces since construction: the updates made during backward that
        the steps committed (``swapped``: of them, those committed without a copy), computed again (a
        segment reduced again) and dropped (see [Note: the overlapped host step] in overlap.py); empty
        without it."""
        return dict(self._overlap.stats) if self._overlap is not None else {}

    def close(self) -> None:
        """Delete the disk-offload files and stop the overlapped step's worker now (otherwise when this
        object is collected, or at exit)."""
        if self._disk is not None:
            self._disk.disk.close()
        if self._overlap is not None:
            self._overlap.close()

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
