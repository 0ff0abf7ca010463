"""The step with optimizer state or master weights stored in fewer bits (see [Note: step backends]).

[Note: the low-precision step]
Chosen when ``optimizer_state_dtype`` is "bf16" or "int8", or ``master_weights_dtype`` is "bf16"
(``ZeroConfig.low_precision_step``). The user's optimizer class still does the arithmetic, in fp32:
each piece is stepped in tiles of ``TILE_NUMEL`` elements (a multiple of every int8 block), and per
tile the stored state is decoded into fp32 scratch, a scratch optimizer of the user's class steps an
fp32 copy of the tile's weights (or the fp32 master itself), and the result is stored back: the
state encoded (engine/optim/lowp.py: ``Int8State``, ``Bf16State``), bf16 weights rounded stochastically (or to
nearest). The inner optimizer's ``state`` keeps each piece's one-number state (the step count) and,
for parameters under ``optimizer_state_min_numel`` elements, torch's own fp32 state; the encoded
state lives here, one encoding per piece and state key, read and written a tile's range at a time.

Speed: the scratch is the same memory at every tile (fp32 buffers of a tile, one per state key and
for the bf16 weights, the gradient and the int8 normalisation, kept from step to step: a few MiB),
and one scratch optimizer of the user's class steps every tile (its param group's settings and
parameter set per tile). What remains above the fp32-state step is the encodings' own work: an
int8 decode is a table lookup and a multiply per element, an encode a block maximum, a divide, a
lookup and integer arithmetic (see [Note: the code table] in engine/optim/lowp.py); stochastic rounding hashes
every element (int64 arithmetic). On CPU each of these is one pass of compiled C (see [Note: the
compiled CPU codec] in kernels/cpu_codec.py), else a dozen torch passes with the same bits.
Figures: benchmarks/RESULTS.md, "Low-precision step time".

Exactness across world sizes and stages: an int8 block holds parameter elements [i * block, (i + 1)
* block), and the flat layout starts every parameter and ends every shard at a multiple of the
block (``ZeroConfig.layout_block``; the layout, not this file, pads: see [Note: blocks that survive a reshard] in
engine/optim/lowp.py), so each block lies whole in one piece and one tile, and its scale
is the same in any layout. Stochastic rounding hashes (seed, step, parameter, element position in
the parameter): the parameter is its index in the user's optimizer, the step is the param group's
``lowp_step`` (a counter this backend keeps in the user's param groups, so it is saved and
loaded with them). So one process and N ranks write the same bits, given the same gradients.

bf16 masters: with ``master_weights_dtype="bf16"`` the config asks for no fp32 copy
(``master_dtype`` None), so the tensor stepped is the bf16 working weights: the rank's shard at
stage 3, its slices of the resident buffer at stages 1-2. No second copy exists.

With optimizer offload (``offload_optimizer``; ``LowPrecisionHostStep``) the fp32 masters, the
gradients' shards and the encoded state are host tensors (so the host holds the state in its stored
form, 1 or 2 bytes per element instead of 4), and the same tiles step there with the user's
settings (not the host step's fused kernel: the arithmetic, and so the bits, are those of the
step without offload); each updated piece is then copied to the device's working weights. bf16
masters are the device's working weights and stay there: they do not combine with offload. Disk
offload and ``offload_overlap`` keep fp32 state (refused with these options: ZeroConfig).

State dicts see fp32: inside ``state_in_memory`` the inner optimizer's state holds every piece's
state decoded to fp32 (what ``state_dict`` returns, so it loads into any ``optimizer_state_dtype``);
after it, the state is encoded again (exact: a decoded value encodes to itself). Sharded
checkpoints write the stored form instead (``stored_state``: int8 codes and scales, or bf16
values; see [Note: stored optimizer state] in checkpoint/sharded.py). A load stores the loaded
state, decoded to fp32, encoded again.
"""

from __future__ import annotations

import contextlib
import logging
import zlib
from typing import Any, Iterator, Optional, Union

import torch

from ....config import ZeroConfig
from ...buffers.host import wait_for_copies
from ..checks import ELEMENTWISE_OPTIMIZERS
from ..lowp import Bf16State, Int8State, round_to_bf16
from ..state import is_elementwise
from ..tiles import CPU_TILE_NUMEL, copy_scalar, hooked_step, unhooked_step
from .backend import StepBackend, Stepped
from .grads import StepGradients
from .host import keep_state_on_host

log = logging.getLogger(__name__)

TILE_NUMEL = 4 * CPU_TILE_NUMEL
"""Elements per tile: a multiple of every allowed int8 block (powers of two up to it). Four times the
fp32 step's tile: the encodings' passes are a few dozen torch calls per tile, whose overhead larger
tiles share out; past this, each pass's temporaries (8 MiB of int32 at 1 << 21) cost more than that."""

INT8_STATE: dict[type, dict[str, bool]] = {
    torch.optim.Adam: {"exp_avg": True, "exp_avg_sq": False, "max_exp_avg_sq": False},
    torch.optim.AdamW: {"exp_avg": True, "exp_avg_sq": False, "max_exp_avg_sq": False},
    torch.optim.SGD: {"momentum_buffer": True},
}
"""The optimizers int8 state covers, and which map each state key takes (True: signed)."""

Encoded = Union[Int8State, Bf16State]
PieceKey = tuple[int, int]


def check_low_precision(config: ZeroConfig, cls: type, stepped: Stepped) -> None:
    """Raise, before training, for a combination the low-precision step does not cover."""
    if config.optimizer_state_dtype == "int8" and cls not in INT8_STATE:
        names = ", ".join(c.__name__ for c in INT8_STATE)
        raise ValueError(f"optimizer_state_dtype='int8' covers {names}; {cls.__name__} is not one of them. Use "
                         "optimizer_state_dtype='bf16' (any of torch's elementwise optimizers) or 'fp32'.")
    if config.optimizer_state_dtype == "bf16" and cls not in ELEMENTWISE_OPTIMIZERS:
        names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        raise ValueError(f"optimizer_state_dtype='bf16' covers torch's own elementwise optimizers ({names}); "
                         f"{cls.__name__} is not one of them (a subclass may keep state the tiles do not see). Use "
                         "optimizer_state_dtype='fp32'.")
    if config.master_weights_dtype == "bf16":
        dtypes = sorted({str(t.dtype) for ts in stepped.tensors for t in ts if t.dtype != torch.bfloat16})
        if dtypes:
            raise ValueError(f"master_weights_dtype='bf16' makes bf16 working weights their own master, but this "
                             f"optimizer steps {', '.join(dtypes)} weights. Train with bf16 weights (precision "
                             "'bf16-mixed' or 'bf16-true'), or keep master_weights_dtype='fp32'.")


def _slot(key: str) -> int:
    """Which random stream a state key's stochastic rounding draws from (0 is the weights')."""
    return 1 + zlib.crc32(key.encode()) % 65521


def _read_whole(value: Any) -> torch.Tensor:
    """A loaded state value as a tensor (state read on demand has ``read_range``: see engine/optim/state.py)."""
    if isinstance(value, torch.Tensor):
        return value
    return value.read_range(0, value.numel()).reshape(value.shape)


class LowPrecisionStep(StepBackend):
    """See [Note: the low-precision step]."""

    def __init__(self, stepped: Stepped, config: ZeroConfig, owner: Any) -> None:
        super().__init__(stepped, config, owner)
        check_low_precision(config, stepped.cls, stepped)
        self.config = config
        self.owner = owner
        index = {p: i for i, p in enumerate(p for g in owner.param_groups for p in g["params"])}
        self.param_key: dict[PieceKey, int] = {}
        self.quantized: dict[PieceKey, bool] = {}
        for gi, g in enumerate(stepped.groups):
            for pi, piece in enumerate(g.pieces):
                self.param_key[(gi, pi)] = index[g.params[piece.param]]
                full = g.layout.numels[piece.param]
                self.quantized[(gi, pi)] = (config.optimizer_state_dtype != "fp32"
                                            and full >= config.optimizer_state_min_numel)
        self.encoded: dict[PieceKey, dict[str, Encoded]] = {}  # per piece, per state key
        self._buffers: dict[tuple[str, Any], torch.Tensor] = {}  # fp32 scratch, reused at every tile
        self._scratch: Optional[torch.optim.Optimizer] = None
        self._loaded: dict[int, dict[str, torch.Tensor]] = {}  # fp32 state taken from a load, by inner index
        stepped.inner.register_load_state_dict_pre_hook(self._take_loaded_state)

    # ---- encodings -------------------------------------------------------------------------

    def _piece(self, key: PieceKey) -> Any:
        return self.stepped.groups[key[0]].pieces[key[1]]

    def _new_encoding(self, key: PieceKey, name: str, numel: int, device: Any) -> Encoded:
        if self.config.optimizer_state_dtype == "int8":
            signed = INT8_STATE[self.stepped.cls].get(name)
            if signed is None:
                raise ValueError(f"{self.stepped.cls.__name__} made state {name!r}, which int8 state has no map for "
                                 f"(known: {sorted(INT8_STATE[self.stepped.cls])}); use optimizer_state_dtype='bf16'.")
            return Int8State.empty(numel, signed, self.config.optimizer_state_block_size, device)
        return Bf16State(torch.zeros(numel, dtype=torch.bfloat16, device=device), self.config.stochastic_rounding,
                         key=self.param_key[key], start=self._piece(key).param_start, slot=_slot(name))

    tile_numel = TILE_NUMEL
    """Elements per tile (a multiple of the int8 block; tests set smaller ones on an instance before
    its first step: the tiles do not change the result)."""

    def _tiles(self, numel: int) -> list[tuple[int, int]]:
        n = self.tile_numel
        assert n % self.config.optimizer_state_block_size == 0, "a tile holds whole int8 blocks"
        return [(lo, min(numel, lo + n)) for lo in range(0, numel, n)] or [(0, 0)]

    def _buffer(self, name: str, numel: int, device: Any) -> torch.Tensor:
        """An fp32 scratch tensor of ``numel`` elements, the same memory at every tile (see [Note: the
        low-precision step])."""
        have = self._buffers.get((name, device))
        if have is None or have.numel() < numel:
            have = self._buffers[(name, device)] = torch.empty(max(numel, self.tile_numel), dtype=torch.float32,
                                                               device=device)
        return have[:numel]

    def _store(self, key: PieceKey, name: str, lo: int, value: torch.Tensor, seed: int, step: int) -> None:
        """Encode ``value`` (fp32) as elements ``[lo, lo + value.numel())`` of the piece's state ``name``."""
        tensor = self.stepped.tensors[key[0]][key[1]]
        codes = self.encoded.setdefault(key, {})
        if name not in codes:
            codes[name] = self._new_encoding(key, name, tensor.numel(), tensor.device)
        target = codes[name]
        if isinstance(target, Bf16State):
            target.encode_range_(lo, value, seed, step)
        else:
            whole_blocks = -(-value.numel() // target.block) * target.block
            target.encode_range_(lo, value, scratch=self._buffer("#normal", whole_blocks, value.device))

    def _store_whole(self, key: PieceKey, name: str, value: torch.Tensor) -> None:
        """Encode a whole piece's fp32 state (a load, the end of ``state_in_memory``)."""
        flat = value.detach().reshape(-1).float()
        for lo, hi in self._tiles(flat.numel()):
            self._store(key, name, lo, flat[lo:hi], self.config.stochastic_rounding_seed, 0)

    def _decode_whole(self, key: PieceKey) -> dict[str, torch.Tensor]:
        return {name: e.decode() for name, e in self.encoded.get(key, {}).items()}

    # ---- the step --------------------------------------------------------------------------

    def update(self, grads: StepGradients) -> None:
        grads.materialize()
        assert grads.pairs is not None
        by_piece = {where: grad.reshape(-1) for where, (_, grad) in zip(grads.where, grads.pairs)}
        for group in self.owner.param_groups:  # the stochastic rounding's step (see the Note)
            group["lowp_step"] = group.get("lowp_step", 0) + 1
        inner, settings = self.stepped.inner, self.stepped.settings_of()
        hooked_step(inner, lambda: self._step_pieces(by_piece, settings))
        self.write_back(by_piece)

    def write_back(self, stepped: dict[PieceKey, torch.Tensor]) -> None:
        """An fp32 master's rounding into bf16/fp16 working weights."""
        self.stepped.write_back()

    def _scratch_optimizer(self, weights: torch.Tensor, hyper: dict[str, Any]) -> torch.optim.Optimizer:
        """The one scratch optimizer of the user's class, over ``weights`` with ``hyper`` now."""
        if self._scratch is None:
            self._scratch = self.stepped.cls([{**hyper, "params": [weights]}], **self.stepped.kwargs)
        opt = self._scratch
        opt.param_groups[0].update(hyper)
        opt.param_groups[0]["params"] = [weights]
        opt.state.clear()  # Adagrad's constructor makes state: the pieces have theirs
        return opt

    def _step_pieces(self, by_piece: dict[PieceKey, torch.Tensor], settings: Any) -> None:
        state = self.stepped.state
        seed = self.config.stochastic_rounding_seed
        round_weights = self.config.master_weights_dtype == "bf16" and self.config.stochastic_rounding
        for key, grad in by_piece.items():
            setting = settings(*key)
            if setting is None:
                continue
            user_index, hyper = setting
            step = int(self.owner.param_groups[user_index].get("lowp_step", 0))
            tensor = self.stepped.tensors[key[0]][key[1]]
            entry = state.get(tensor, {})
            quantized = self.quantized[key]
            scalars_after: dict[str, Any] = {}
            fp32_state: dict[str, torch.Tensor] = {}
            start = self._piece(key).param_start
            had = dict(self.encoded.get(key, {}))  # the state before this step (its first tile may add some)
            for lo, hi in self._tiles(tensor.numel()):
                n, part = hi - lo, tensor[lo:hi]
                weights = part if part.dtype == torch.float32 else self._buffer("#weights", n, part.device).copy_(part)
                scratch_state: dict[str, Any] = {k: copy_scalar(v) for k, v in entry.items() if not is_elementwise(v)}
                if quantized:
                    for name, stored in had.items():
                        scratch_state[name] = stored.decode_range(lo, hi, out=self._buffer(name, n, part.device))
                else:
                    for name, v in entry.items():
                        if is_elementwise(v):
                            scratch_state[name] = v[lo:hi]  # torch's fp32 state, stepped in place
                g = grad[lo:hi]
                weights.grad = g if g.dtype == torch.float32 else self._buffer("#grad", n, g.device).copy_(g)
                opt = self._scratch_optimizer(weights, hyper)
                if scratch_state:
                    opt.state[weights] = scratch_state
                try:
                    unhooked_step(opt)
                finally:
                    weights.grad = None
                new = opt.state.pop(weights, {})
                opt.param_groups[0]["params"] = []
                for name, value in new.items():
                    if not is_elementwise(value):
                        scalars_after[name] = value
                    elif quantized:
                        self._store(key, name, lo, value, seed, step)
                    elif not is_elementwise(entry.get(name)):  # state the piece gets at this step
                        whole = fp32_state.setdefault(name, torch.empty(tensor.numel(), dtype=value.dtype,
                                                                        device=value.device))
                        whole[lo:hi].copy_(value.reshape(-1))
                if weights is not part:
                    if part.dtype == torch.bfloat16:
                        round_to_bf16(weights, round_weights, seed, step, self.param_key[key], start + lo, 0, out=part)
                    else:
                        part.copy_(weights)
            merged = {k: v for k, v in entry.items() if is_elementwise(v)}
            state[tensor] = {**merged, **fp32_state, **scalars_after}

    # ---- checkpoints and loads -------------------------------------------------------------

    @contextlib.contextmanager
    def state_in_memory(self, decoded: bool = True) -> Iterator[None]:
        if not decoded:  # a checkpoint writes the stored form (``stored_state``) itself
            yield
            return
        state = self.stepped.state
        decoded = []
        for key in list(self.encoded):
            tensor = self.stepped.tensors[key[0]][key[1]]
            state[tensor] = {**state.get(tensor, {}), **self._decode_whole(key)}
            decoded.append((key, tensor))
        try:
            yield
        finally:
            for key, tensor in decoded:
                entry = self.stepped.state_of(tensor)
                for name in list(entry):
                    if is_elementwise(entry[name]):
                        self._store_whole(key, name, entry.pop(name))

    def stored_state(self, key: PieceKey) -> dict[str, Encoded]:
        return self.encoded.get(key, {})

    def _take_loaded_state(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Before torch's load casts the state to the stepped tensors' dtype (bf16 masters), keep every
        piece's elementwise state in fp32 here: ``state_loaded`` encodes it (or keeps it, fp32)."""
        self._loaded = {}
        state = dict(state_dict["state"])
        for j, entry in list(state.items()):
            self._loaded[j] = {k: _read_whole(v).float() for k, v in entry.items() if is_elementwise(v)}
            state[j] = {k: v for k, v in entry.items() if not is_elementwise(v)}
        return {**state_dict, "state": state}

    def _inner_order(self) -> list[PieceKey]:
        """The pieces in the order of the inner optimizer's parameters."""
        where = {id(t): (gi, pi) for gi, ts in enumerate(self.stepped.tensors) for pi, t in enumerate(ts)}
        return [where[id(t)] for g in self.stepped.inner.param_groups for t in g["params"]]

    def state_loaded(self) -> None:
        self.encoded = {}
        order = self._inner_order()
        state = self.stepped.state
        encoded = 0
        for j, values in self._loaded.items():
            key = order[j]
            if not self.quantized[key]:
                tensor = self.stepped.tensors[key[0]][key[1]]
                state[tensor] = {**state.get(tensor, {}), **{k: v.clone() for k, v in values.items()}}
                continue
            for name, value in values.items():
                self._store_whole(key, name, value)
                encoded += 1
        if encoded:
            log.info("optimizer state loaded (fp32, as checkpoints hold it) and stored as %s: %d state tensors",
                     self.config.optimizer_state_dtype, encoded)
        self._loaded = {}

    # ---- accounting ------------------------------------------------------------------------

    def held(self) -> dict[str, list[torch.Tensor]]:
        return {**super().held(), "stored_states": self.stored_tensors()}

    def stored_tensors(self) -> list[torch.Tensor]:
        """The encoded state: int8 codes and their scales, or bf16 values."""
        out: list[torch.Tensor] = []
        for per_key in self.encoded.values():
            for e in per_key.values():
                out += [e.codes, e.scales] if isinstance(e, Int8State) else [e.values]
        return out

    def stored_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.stored_tensors())


class LowPrecisionHostStep(LowPrecisionStep):
    """The low-precision step on offloaded pieces: host masters, gradients and encoded state (see
    [Note: the low-precision step])."""

    on_host = True

    def gradients_reduced(self) -> None:
        wait_for_copies(self.stepped.device)  # the gradients' copies to the host

    def update(self, grads: StepGradients) -> None:
        self.keep_state_on_host()
        super().update(grads)

    def write_back(self, stepped: dict[PieceKey, torch.Tensor]) -> None:
        """Copy each stepped piece's master to the device's working weights, then wait for the copies."""
        for gi, pi in stepped:
            g = self.stepped.groups[gi]
            g.write_back_piece(g.pieces[pi])
        wait_for_copies(self.stepped.device)

    def keep_state_on_host(self) -> None:
        keep_state_on_host(self.stepped.state, self.stepped.tensors)

    def state_loaded(self) -> None:
        super().state_loaded()
        self.keep_state_on_host()
