"""The update of optimizers that read a whole parameter (Muon, Adafactor): see [Note: whole-parameter step].

[Note: whole-parameter step]
Muon orthogonalises each 2-D weight's momentum as one matrix (Newton-Schulz iterations); Adafactor
factors a parameter's second moment over its rows and columns. Neither update can run on the
pieces of a flat shard (see [Note: pieces] in engine/buffers/layout.py), which cut parameters at
arbitrary elements. So for these classes each parameter has one owner, the rank that steps it whole:

- owners are chosen once, the same on every rank: parameters by size, largest first (ties: in
  order), each to the rank with the fewest elements so far (ties: the lowest rank). A rank's state
  is then its owned parameters' whole state: about 1/N of the total, plus at most the largest
  parameter's (``WholePlan``).
- at the step each rank sends every piece it holds to the piece's owner, its master values and its
  reduced (unscaled, clipped) gradient in the masters' dtype and one flag (it has a gradient), in
  one all-to-all of unequal parts; the owner puts them together into whole tensors of the
  parameter's own shape, steps them with the user's class re-created over those tensors (with the
  user's param groups and settings), and sends each piece's new values back in a second all-to-all,
  which land in the stepped tensors; the write-back and the all-gather of the weights follow as for
  every step. Bytes per rank: about 2 x (N-1)/N of its shard's masters and gradients out, and the
  new values back: one shard's worth three times, where the elementwise step sends nothing.
- the whole tensors live only for the step: their storage is given back after it (the optimizer's
  state is keyed by the tensor objects, which stay), so between steps a rank holds its pieces and
  its owned parameters' state, nothing whole.
- a parameter with no gradient on any rank is skipped, as torch skips it; with a gradient on some
  rank it has one on every rank after the reduction, so the flags agree.

The state dict is torch's layout (every parameter's state by index, gathered from the owners onto
every rank), so it loads at any world size and stage and from a DDP run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from ....config import ZeroConfig
from ...buffers.flat import FlatGroup
from ...buffers.layout import Piece
from .backend import StepBackend, Stepped
from .grads import StepGradients


@dataclass(frozen=True)
class _Param:
    group: int  # flat group index
    index: int  # parameter index in the group
    shape: torch.Size
    numel: int
    user_group: int  # the user's param group


class WholePlan:
    """Who steps each parameter, and the order of the pieces in the step's two all-to-alls."""

    def __init__(self, groups: list[FlatGroup], user_group_of: dict[int, int], world_size: int, rank: int) -> None:
        self.world_size, self.rank = world_size, rank
        self.params = [_Param(gi, i, g.shapes[i], g.layout.numels[i], user_group_of[id(g.params[i])])
                       for gi, g in enumerate(groups) for i in range(len(g.params))]
        load = [0] * world_size
        self.owner: dict[tuple[int, int], int] = {}
        for p in sorted(self.params, key=lambda p: -p.numel):  # stable: ties keep their order
            r = min(range(world_size), key=lambda r: (load[r], r))
            self.owner[p.group, p.index] = r
            load[r] += p.numel
        self.load = load
        # every rank's pieces, group by group, in buffer order: both sides of an all-to-all walk these
        self.pieces = [[(gi, piece) for gi, g in enumerate(groups) for piece in g.layout.pieces(r)]
                       for r in range(world_size)]
        self.owned = [p for p in self.params if self.owner[p.group, p.index] == rank]

    def sent(self, rank: int, to: int) -> list[tuple[int, Piece]]:
        """``rank``'s pieces whose owner is ``to``, in the order they travel."""
        return [(gi, piece) for gi, piece in self.pieces[rank] if self.owner[gi, piece.param] == to]


class WholeParameterStep(StepBackend):
    """Each parameter stepped whole by its owner (see [Note: whole-parameter step])."""

    def __init__(self, stepped: Stepped, config: ZeroConfig, owner: Any) -> None:
        super().__init__(stepped, config, owner)
        comm = owner.comm
        for g in stepped.groups:
            if g.layout.world_size != comm.world_size:
                raise ValueError(f"the whole-parameter step runs over the shard group of {comm.world_size} ranks, "
                                 f"but a flat group is sharded over {g.layout.world_size}")
        self.comm = comm
        user_group_of = {id(p): gi for gi, group in enumerate(owner.optim.param_groups) for p in group["params"]}
        self.plan = WholePlan(stepped.groups, user_group_of, comm.world_size, comm.rank)
        dtypes = {g.master_shard.dtype if g.master_shard is not None else g.dtype for g in stepped.groups}
        if len(dtypes) > 1:
            raise ValueError(f"{owner.optim.__class__.__name__} is stepped whole, over parameters of one dtype; its "
                             f"param groups step {sorted(map(str, dtypes))}: give it parameters of one dtype.")
        dtype = self.dtype = dtypes.pop() if dtypes else torch.float32
        device = stepped.device
        # the owned parameters, whole, their own shapes (the class may check them: Muon's 2-D rule); their
        # storage exists only during a step
        self.whole = {(p.group, p.index): torch.empty(p.shape, dtype=dtype, device=device) for p in self.plan.owned}
        self._whole_inner: Optional[torch.optim.Optimizer] = None
        if self.plan.owned:
            groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []}
                      for g in stepped.inner.param_groups]
            for p in self.plan.owned:
                groups[p.user_group]["params"].append(self.whole[p.group, p.index])
            self._whole_groups = [gi for gi, g in enumerate(groups) if g["params"]]
            self._whole_inner = owner.optim.__class__([g for g in groups if g["params"]], **stepped.kwargs)
        self._release()

    def _release(self) -> None:
        for tensor in self.whole.values():  # nothing whole outlives the step (the state keys stay)
            tensor.data = torch.empty(0, dtype=self.dtype, device=tensor.device)

    whole_parameters = True

    @classmethod
    def build_inner(cls, optimizer_cls: type, groups: list[dict[str, Any]], kwargs: dict[str, Any]
                    ) -> torch.optim.Optimizer:
        """Over the pieces, only the settings: the base class, which never steps (the update is the
        class's own over whole tensors, above)."""
        return torch.optim.Optimizer(groups, dict(kwargs))

    @property
    def inner(self) -> Optional[torch.optim.Optimizer]:
        """The user's class re-created over this rank's owned parameters, whole (None: it owns none)."""
        return self._whole_inner

    # ---- the step ---------------------------------------------------------------------------

    def update(self, grads: StepGradients) -> None:
        grads.materialize()
        assert grads.pairs is not None
        got = {where: grad for where, (_, grad) in zip(grads.where, grads.pairs)}
        plan, stepped, comm = self.plan, self.stepped, self.comm
        piece_index = {(gi, piece): pi for gi, g in enumerate(stepped.groups) for pi, piece in enumerate(g.pieces)}

        def stride(piece: Piece) -> int:
            return 2 * piece.numel + 1

        sent_parts, sent_splits = [], []
        for to in range(plan.world_size):
            parts = []
            for gi, piece in plan.sent(plan.rank, to):
                pi = piece_index[gi, piece]
                values = stepped.tensors[gi][pi].detach().reshape(-1)
                grad = got.get((gi, pi))
                flag = torch.ones(1, dtype=self.dtype, device=values.device)
                if grad is None:
                    grad, flag = torch.zeros_like(values), flag.zero_()
                parts += [values, grad.reshape(-1).to(self.dtype), flag]
            sent_parts += parts
            sent_splits.append(sum(p.numel() for p in parts))
        received_splits = [sum(stride(piece) for _, piece in plan.sent(s, plan.rank)) for s in range(plan.world_size)]
        sent = torch.cat(sent_parts) if sent_parts else torch.empty(0, dtype=self.dtype, device=stepped.device)
        received = torch.empty(sum(received_splits), dtype=self.dtype, device=sent.device)
        comm.all_to_all(received, sent, received_splits, sent_splits,
                        lambda: "all-to-all of the pieces to the ranks that step each parameter whole")

        shapes = {(p.group, p.index): p.shape for p in plan.owned}
        values = {key: torch.empty(shape, dtype=self.dtype, device=sent.device) for key, shape in shapes.items()}
        gradients = {key: torch.empty(shape, dtype=self.dtype, device=sent.device) for key, shape in shapes.items()}
        has_grad: dict[tuple[int, int], bool] = {}
        at = 0
        for s in range(plan.world_size):
            for gi, piece in plan.sent(s, plan.rank):
                key, n = (gi, piece.param), piece.numel
                values[key].view(-1)[piece.param_start:piece.param_end] = received[at:at + n]
                gradients[key].view(-1)[piece.param_start:piece.param_end] = received[at + n:at + 2 * n]
                has_grad[key] = bool(received[at + 2 * n].item())
                at += stride(piece)
        del received, sent, sent_parts

        if self._whole_inner is not None:
            for inner_group, gi in zip(self._whole_inner.param_groups, self._whole_groups):
                inner_group.update({k: v for k, v in stepped.inner.param_groups[gi].items() if k != "params"})
            for key, tensor in self.whole.items():
                tensor.data = values[key]
                tensor.grad = gradients[key] if has_grad.get(key, False) else None
            self._whole_inner.step()
            for tensor in self.whole.values():
                tensor.grad = None

        back_parts, back_splits = [], []
        for to in range(plan.world_size):
            parts = [values[gi, piece.param].view(-1)[piece.param_start:piece.param_end]
                     for gi, piece in plan.sent(to, plan.rank)]
            back_parts += parts
            back_splits.append(sum(p.numel() for p in parts))
        mine = [sum(piece.numel for _, piece in plan.sent(plan.rank, s)) for s in range(plan.world_size)]
        back = torch.cat(back_parts) if back_parts else torch.empty(0, dtype=self.dtype, device=stepped.device)
        updated = torch.empty(sum(mine), dtype=self.dtype, device=back.device)
        comm.all_to_all(updated, back, mine, back_splits,
                        lambda: "all-to-all of the stepped parameters back to the ranks that hold their pieces")
        self._release()
        del values, gradients, back, back_parts
        at = 0
        with torch.no_grad():
            for s in range(plan.world_size):
                for gi, piece in plan.sent(plan.rank, s):
                    pi = piece_index[gi, piece]
                    stepped.tensors[gi][pi].view(-1).copy_(updated[at:at + piece.numel])
                    at += piece.numel
        stepped.write_back()

    # ---- state: torch's layout, by the user's parameter index -------------------------------------

    def index_of(self, zopt) -> dict[tuple[int, int], int]:
        """(flat group, parameter) -> the parameter's index in the user's param groups."""
        index = {p: i for i, p in enumerate(p for g in zopt.param_groups for p in g["params"])}
        return {(gi, i): index[p] for gi, g in enumerate(self.stepped.groups) for i, p in enumerate(g.params)}

    def owned_state(self, index_of: dict[tuple[int, int], int]) -> dict[int, dict[str, Any]]:
        """This rank's owned parameters' state (CPU copies), by the user's parameter index."""
        if self._whole_inner is None:
            return {}
        out = {}
        for key, tensor in self.whole.items():
            state = self._whole_inner.state.get(tensor)
            if state:
                out[index_of[key]] = {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
                                      for k, v in state.items()}
        return out

    def owned_items(self) -> Iterator[tuple[torch.nn.Parameter, dict[str, Any]]]:
        """Each owned parameter (the user's) with its state, for a checkpoint to write whole."""
        if self._whole_inner is None:
            return
        for (gi, i), tensor in self.whole.items():
            state = self._whole_inner.state.get(tensor)
            if state:
                yield self.stepped.groups[gi].params[i], state

    def load_owned_state(self, state: dict[int, dict[str, Any]], index_of: dict[tuple[int, int], int]) -> None:
        """Take the owned parameters' entries of ``state`` (torch's layout: by the user's index)."""
        if self._whole_inner is None:
            return
        self._whole_inner.state.clear()
        for key, tensor in self.whole.items():
            entry = state.get(index_of[key])
            if entry:
                self._whole_inner.state[tensor] = {k: _whole(v, tensor.device) for k, v in entry.items()}




def _whole(value: Any, device: torch.device) -> Any:
    """A state entry as a tensor on ``device``: one read from a checkpoint a range at a time (``read_range``:
    see checkpoint/sharded.py) is read whole."""
    if hasattr(value, "read_range"):
        value = value.read_range(0, value.numel()).reshape(value.shape)
    return value.to(device) if isinstance(value, torch.Tensor) else value


def whole_state_dict(zopt, backend: WholeParameterStep) -> dict[str, Any]:
    """torch's ``state_dict()`` layout: every parameter's state (CPU tensors) by index, gathered from the
    ranks that own them onto every rank, and the param groups. A collective."""
    merged: dict[int, dict[str, Any]] = {}
    for part in zopt.comm.all_gather_object(backend.owned_state(backend.index_of(zopt))):
        merged.update(part)
    index = {p: i for i, p in enumerate(p for g in zopt.param_groups for p in g["params"])}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[p] for p in g["params"]]}
              for g in zopt.param_groups]
    return {"state": dict(sorted(merged.items())), "param_groups": groups}


def load_whole_state_dict(zopt, backend: WholeParameterStep, state_dict: dict[str, Any]) -> None:
    """The inverse of ``whole_state_dict`` (from any world size, stage or a DDP run's ``state_dict()``):
    each rank keeps its owned parameters' state; the param groups' settings are the saved ones."""
    groups = state_dict["param_groups"]
    if len(groups) != len(zopt.param_groups) or any(
            len(saved["params"]) != len(mine["params"]) for saved, mine in zip(groups, zopt.param_groups)):
        raise ValueError(f"the optimizer state dict has {[len(g['params']) for g in groups]} parameters per param "
                         f"group, this optimizer {[len(g['params']) for g in zopt.param_groups]}: it was saved for "
                         "another model or optimizer.")
    for mine, saved in zip(zopt.param_groups, groups):
        mine.update({k: v for k, v in saved.items() if k != "params"})
    state = {int(k): v for k, v in state_dict["state"].items()}
    backend.load_owned_state(state, backend.index_of(zopt))
