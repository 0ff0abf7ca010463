"""Optimizer state in the unsharded layout of the user's optimizer, and back.

``consolidate_state`` gathers every rank's pieces into full tensors keyed by parameter index, the
layout ``torch.optim.Optimizer.state_dict()`` would produce without sharding. So a state dict
saved at one world size loads at any other, and one from a plain (DDP) run loads here.
``shard_state`` is its inverse. Both are collectives: every rank must call them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_ELEMENTWISE = "elementwise"  # a tensor shaped like the piece: sharded, gathered on save


def is_elementwise(value: Any) -> bool:
    """Optimizer state with one entry per element of its parameter (Adam's moments): sharded like
    the parameter, gathered on save, offloaded to disk. The rest (the step count) is one number per
    parameter, the same in each of its pieces. ``value`` may also be state still on disk (an object
    with ``read_range`` and ``dim()``: see ``_piece_of``)."""
    return (isinstance(value, torch.Tensor) or hasattr(value, "read_range")) and value.dim() > 0


def _kind(value: Any) -> tuple[str, str]:
    if isinstance(value, torch.Tensor):
        return (_ELEMENTWISE if is_elementwise(value) else "tensor", str(value.dtype).removeprefix("torch."))
    return (type(value).__name__, "")


def by_group(zopt) -> list[tuple[Any, list]]:
    """``zopt.pieces()`` by flat group: (group, its pieces' refs), every group, in order."""
    refs: list[list] = [[] for _ in zopt.groups]
    for ref in zopt.pieces():
        refs[ref.group_index].append(ref)
    return list(zip(zopt.groups, refs))


def _agree_on_kinds(zopt, local: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
    """Union of the state keys (and their kinds) over ranks; ranks without state learn them."""
    merged: dict[str, tuple[str, str]] = {}
    for kinds in zopt.comm.all_gather_object(local):
        merged.update(kinds)
    return dict(sorted(merged.items()))


def param_index(zopt) -> dict[torch.nn.Parameter, int]:
    return {p: i for i, p in enumerate(p for g in zopt.param_groups for p in g["params"])}


def param_groups_out(zopt, index: dict) -> list[dict[str, Any]]:
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[p] for p in g["params"]]}
            for g in zopt.param_groups]


def consolidate_state(zopt) -> dict[str, Any]:
    """Full optimizer state (CPU tensors) keyed by parameter index, on every rank."""
    index = param_index(zopt)
    state: dict[int, dict[str, Any]] = {}
    for g, refs in by_group(zopt):
        kinds = {k: _kind(v) for ref in refs for k, v in zopt.piece_state(ref).items()}
        kinds = _agree_on_kinds(zopt, kinds)
        if not kinds:
            continue
        device = g.device
        has_state = torch.zeros(len(g.params), dtype=torch.uint8, device=device)
        for ref in refs:
            if ref.tensor in zopt.state:  # an entry, even an empty one (torch's defaultdict makes those)
                has_state[ref.piece.param] = 1
        zopt.comm.all_reduce(has_state, op=dist.ReduceOp.MAX, what=lambda: "all-reduce of which parameters have state")
        with_state = [i for i, flag in enumerate(has_state.tolist()) if flag]
        for i in with_state:
            state[index[g.params[i]]] = {}
        for key, (kind, dtype) in kinds.items():
            if kind == _ELEMENTWISE:
                shard = torch.zeros(g.layout.shard_numel, dtype=getattr(torch, dtype), device=device)
                for ref in refs:
                    if key in zopt.piece_state(ref):
                        g.shard_slice(shard, ref.piece).copy_(zopt.piece_state(ref)[key])
                gathered = zopt.comm.all_gather_shards(shard, lambda: f"all-gather of optimizer state {key!r}")  # (N, shard)
                for i in with_state:
                    state[index[g.params[i]]][key] = _full_param(g, gathered, i).cpu()
            else:  # one number per parameter, the same in every piece of it
                values = torch.full((len(g.params),), float("-inf"), dtype=torch.float64, device=device)
                for ref in refs:
                    if key in zopt.piece_state(ref):
                        values[ref.piece.param] = float(zopt.piece_state(ref)[key])
                zopt.comm.all_reduce(values, op=dist.ReduceOp.MAX, what=lambda: f"all-reduce of optimizer state {key!r}")
                for i in with_state:
                    state[index[g.params[i]]][key] = _number(values[i].item(), kind, dtype)
    return {"state": state, "param_groups": param_groups_out(zopt, index)}


def _full_param(group, gathered: torch.Tensor, i: int) -> torch.Tensor:
    """Parameter ``i`` of ``group`` out of every rank's shard, shaped like the parameter."""
    seg = group.segments[group.layout.param_segments[i]]
    full_segment = gathered[:, seg.shard_start : seg.shard_start + seg.shard_numel].reshape(-1)
    off = group.layout.param_offsets[i] - seg.start
    return full_segment[off : off + group.layout.numels[i]].view(group.shapes[i]).clone()


def _number(value: float, kind: str, dtype: str) -> Any:
    if kind == "tensor":
        return torch.tensor(value, dtype=getattr(torch, dtype))
    return int(value) if kind == "int" else value


def _piece_of(value: Any, start: int, end: int) -> torch.Tensor:
    """Elements ``[start, end)`` of a flattened state tensor, or of one still on disk: an object with
    ``read_range(start, end)``, ``dim()``, ``numel()`` and ``shape`` (a sharded checkpoint's, read a
    piece at a time)."""
    if isinstance(value, torch.Tensor):
        return value.reshape(-1)[start:end].clone()
    return value.read_range(start, end)


def shard_state(zopt, state_dict: dict[str, Any]) -> None:
    """Load an unsharded optimizer state dict into this rank's pieces.

    Elementwise values may be tensors, or objects that read a range on demand (see ``_piece_of``).
    """
    saved_id = saved_ids(zopt, state_dict)
    saved_groups = state_dict["param_groups"]
    saved_state = state_dict["state"]

    inner_state: dict[int, dict[str, Any]] = {}
    inner_index = {t: j for j, t in enumerate(t for g in zopt.inner.param_groups for t in g["params"])}
    for ref in zopt.pieces():
        entry = saved_state.get(saved_id[ref.param])
        if entry is None:
            continue
        shape = ref.group.shapes[ref.piece.param]
        out = {}
        for key, value in entry.items():
            if is_elementwise(value):
                if value.numel() != shape.numel():
                    raise ValueError(f"optimizer state {key!r} of parameter {saved_id[ref.param]} has shape "
                                     f"{tuple(value.shape)}, the parameter has {tuple(shape)}: "
                                     "the checkpoint is for a different model.")
                value = _piece_of(value, ref.piece.param_start, ref.piece.param_end)
            out[key] = value
        inner_state[inner_index[ref.tensor]] = out
    inner_groups = [{**saved, "params": [inner_index[t] for t in g["params"]]}
                    for saved, g in zip(saved_groups, zopt.inner.param_groups)]
    zopt.inner.load_state_dict({"state": inner_state, "param_groups": inner_groups})
    take_settings(zopt, saved_groups)


def saved_ids(zopt, state_dict: dict[str, Any]) -> dict[torch.nn.Parameter, Any]:
    """Each of ``zopt``'s parameters' id in ``state_dict`` (an unsharded optimizer state dict), which must
    fit this optimizer's param groups. Saved ids may be any integers: they map through the group order,
    as torch maps them."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("an optimizer state dict needs the keys 'state' and 'param_groups'; "
                         f"got {sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__}")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(zopt.param_groups):
        raise ValueError(f"the state dict has {len(saved_groups)} param groups, this optimizer has "
                         f"{len(zopt.param_groups)}: it was saved for a different configure_optimizers.")
    for gi, (saved, group) in enumerate(zip(saved_groups, zopt.param_groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(f"param group {gi} has {len(saved['params'])} parameters in the state dict and "
                             f"{len(group['params'])} here: the checkpoint is for a different model.")
    return {p: sid for saved, g in zip(saved_groups, zopt.param_groups) for p, sid in zip(g["params"], saved["params"])}


def take_settings(zopt, saved_groups: list[dict[str, Any]]) -> None:
    """The saved param groups' hyperparameters into ``zopt``'s (the user's: LR schedulers see them)."""
    for saved, group in zip(saved_groups, zopt.param_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
