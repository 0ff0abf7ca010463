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
  every step. Bytes per rank: its pieces' masters and gradients out (up to two shards' worth) and
  their new values back (up to one), less its own pieces of the parameters it owns, which stay;
  the elementwise step sends none of these.
- the whole tensors live only for the step: their storage is given back after it (the optimizer's
  state is keyed by the tensor objects, which stay), so between steps a rank holds its pieces and
  its owned parameters' state, nothing whole.
- a parameter with no gradient on any rank is skipped, as torch skips it; with a gradient on some
  rank it has one on every rank after the reduction, so the flags agree.

[Note: a norm over all ranks' updates]
A class may need one number from every rank's parameters before it applies its updates: DeepSpeed's
Muon clips by a norm taken over the Muon updates and the Adam gradients together (``DeepSpeedMuon``
in optimizers.py). Such a class splits its step in two, ``prepare_step()`` (computes what it needs
and returns its share of the squared norm, or None when it needs none: the same answer on every rank,
as it depends on the settings only) and ``finish_step(total)``; here every rank builds the class (an
owner of nothing over empty groups), calls the first, sums the shares over the ranks in one 8-byte
all-reduce when there are some, and calls the second with the sum.

The state dict is torch's layout (every parameter's state by index, gathered from the owners onto
every rank), so it loads at any world size and stage and from a DDP run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

from ....config import ZeroConfig
from ...buffers.flat import FlatGroup
from ...buffers.layout import GroupLayout, Piece
from ..state import param_index, param_groups_out, saved_ids, take_settings
from .backend import StepBackend, Stepped
from .grads import StepGradients

Piece3 = tuple[int, int, Piece]  # (flat group, index in its pieces, piece)


@dataclass(frozen=True)
class _Param:
    group: int  # flat group index
    index: int  # parameter index in the group
    shape: torch.Size
    numel: int
    user_group: int  # the user's param group


def assign_owners(numels: Sequence[Sequence[int]], world_size: int) -> dict[tuple[int, int], int]:
    """(flat group, parameter index) -> the rank that steps the parameter whole: largest first (ties keep
    their order), each to the rank with the fewest elements so far (ties: the lowest rank). The same on
    every rank, and in the communication model (comm_model.py)."""
    load = [0] * world_size
    owner: dict[tuple[int, int], int] = {}
    params = [(gi, i, n) for gi, group in enumerate(numels) for i, n in enumerate(group)]
    for gi, i, n in sorted(params, key=lambda x: -x[2]):  # stable
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[gi, i] = r
        load[r] += n
    return owner


def exchanged(layouts: Sequence[GroupLayout], owner: dict[tuple[int, int], int], world_size: int,
              rank: int) -> tuple[list[list[Piece3]], list[list[Piece3]]]:
    """Per rank j: this rank's pieces of the parameters j owns (sent to j), and j's pieces of the parameters
    this rank owns (received from j), group by group in buffer order (both sides walk them alike)."""
    def pieces_of(r: int) -> list[Piece3]:  # rank r's pieces, indexed as ``FlatGroup.pieces``
        return [(gi, pi, piece) for gi, layout in enumerate(layouts) for pi, piece in enumerate(layout.pieces(r))]

    mine = pieces_of(rank)
    outgoing = [[x for x in mine if owner[x[0], x[2].param] == to] for to in range(world_size)]
    incoming = [[x for x in pieces_of(r) if owner[x[0], x[2].param] == rank] for r in range(world_size)]
    return outgoing, incoming


def step_elements(layouts: Sequence[GroupLayout], world_size: int, rank: int) -> tuple[int, int]:
    """Elements ``rank`` sends to the other ranks in the step's two all-to-alls: its pieces' values and
    gradients and a flag per piece, then the new values of the pieces of the parameters it owns."""
    owner = assign_owners([layout.numels for layout in layouts], world_size)
    outgoing, incoming = exchanged(layouts, owner, world_size, rank)
    first = sum(2 * piece.numel + 1 for j, pieces in enumerate(outgoing) if j != rank for *_, piece in pieces)
    second = sum(piece.numel for j, pieces in enumerate(incoming) if j != rank for *_, piece in pieces)
    return first, second


class WholePlan:
    """Who steps each parameter, and which pieces travel where in the step's two all-to-alls."""

    def __init__(self, groups: list[FlatGroup], user_group_of: dict[int, int], world_size: int, rank: int) -> None:
        self.params = [_Param(gi, i, g.shapes[i], g.layout.numels[i], user_group_of[id(g.params[i])])
                       for gi, g in enumerate(groups) for i in range(len(g.params))]
        owner = assign_owners([g.layout.numels for g in groups], world_size)
        self.owned = [p for p in self.params if owner[p.group, p.index] == rank]
        self.outgoing, self.incoming = exchanged([g.layout for g in groups], owner, world_size, rank)
        """Per rank: this rank's pieces of its parameters; its pieces of the parameters this rank owns."""
        self.out_numel = [sum(piece.numel for *_, piece in pieces) for pieces in self.outgoing]
        self.in_numel = [sum(piece.numel for *_, piece in pieces) for pieces in self.incoming]


class WholeParameterStep(StepBackend):
    """Each parameter stepped whole by its owner (see [Note: whole-parameter step])."""

    whole_parameters = True

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
        self.dtype = dtypes.pop() if dtypes else torch.float32
        # the owned parameters, whole, their own shapes (the class may check them: Muon's 2-D rule); their
        # storage exists only during a step
        self.whole = {(p.group, p.index): torch.empty(p.shape, dtype=self.dtype, device=stepped.device)
                      for p in self.plan.owned}
        self._whole_inner: Optional[torch.optim.Optimizer] = None
        self._two_phase = hasattr(owner.optim, "prepare_step")  # see [Note: a norm over all ranks' updates]
        if self.plan.owned or self._two_phase:
            groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []}
                      for g in stepped.inner.param_groups]
            for p in self.plan.owned:
                groups[p.user_group]["params"].append(self.whole[p.group, p.index])
            self._whole_groups = [gi for gi, g in enumerate(groups) if g["params"] or self._two_phase]
            self._whole_inner = owner.optim.__class__([groups[gi] for gi in self._whole_groups], **stepped.kwargs)
        self._release()

    def _release(self) -> None:
        for tensor in self.whole.values():  # nothing whole outlives the step (the state keys stay)
            tensor.data = torch.empty(0, dtype=self.dtype, device=tensor.device)

    @classmethod
    def build_inner(cls, optimizer_cls: type, groups: list[dict[str, Any]], kwargs: dict[str, Any]
                    ) -> torch.optim.Optimizer:
        """Over the pieces, only the settings: the base class, which never steps (the update is the
        class's own over whole tensors, above)."""
        return torch.optim.Optimizer(groups, dict(kwargs))

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """The owned parameters' state, keyed by their whole tensors."""
        return self._whole_inner.state if self._whole_inner is not None else {}

    # ---- the step ---------------------------------------------------------------------------

    def _exchange(self, parts: list[torch.Tensor], sent: list[int], received: list[int], what: str) -> torch.Tensor:
        """``parts`` concatenated, ``sent[j]`` elements of them to rank j; what every rank sent here."""
        out = torch.cat(parts) if parts else torch.empty(0, dtype=self.dtype, device=self.stepped.device)
        into = torch.empty(sum(received), dtype=self.dtype, device=out.device)
        self.comm.all_to_all(into, out, received, sent, lambda: what)
        return into

    def update(self, grads: StepGradients) -> None:
        grads.materialize()  # the masters' dtype, fully scaled
        got = dict(zip(grads.where, grads.grads))  # (group, piece) -> its gradient
        plan, stepped = self.plan, self.stepped
        parts = []
        for pieces in plan.outgoing:  # each piece: its values, its gradient (or zeros), whether it has one
            for gi, pi, _ in pieces:
                values, grad = stepped.tensors[gi][pi].detach().reshape(-1), got.get((gi, pi))
                parts += [values, torch.zeros_like(values) if grad is None else grad.reshape(-1),
                          values.new_full((1,), float(grad is not None))]
        received = self._exchange(
            parts, [2 * n + len(pieces) for n, pieces in zip(plan.out_numel, plan.outgoing)],
            [2 * n + len(pieces) for n, pieces in zip(plan.in_numel, plan.incoming)],
            "all-to-all of the pieces to the ranks that step each parameter whole")
        del parts

        values = {(p.group, p.index): received.new_empty(p.shape) for p in plan.owned}
        gradients = {key: torch.empty_like(v) for key, v in values.items()}
        keys, flags_at, at = [], [], 0
        for pieces in plan.incoming:
            for gi, _, piece in pieces:
                key, n, lo, hi = (gi, piece.param), piece.numel, piece.param_start, piece.param_end
                values[key].view(-1)[lo:hi] = received[at:at + n]
                gradients[key].view(-1)[lo:hi] = received[at + n:at + 2 * n]
                keys.append(key)
                flags_at.append(at + 2 * n)
                at += 2 * n + 1
        has_grad = {key for key, flag in zip(keys, received[flags_at].tolist()) if flag}  # one read of the flags
        del received

        if self._whole_inner is not None:
            for inner_group, gi in zip(self._whole_inner.param_groups, self._whole_groups):
                inner_group.update({k: v for k, v in stepped.inner.param_groups[gi].items() if k != "params"})
            for key, tensor in self.whole.items():
                tensor.data = values[key]
                tensor.grad = gradients[key] if key in has_grad else None
            if self._two_phase:
                share = self._whole_inner.prepare_step()
                if share is not None:
                    self.comm.all_reduce(share, what=lambda: "all-reduce of the squared norm of the updates")
                self._whole_inner.finish_step(share)
            else:
                self._whole_inner.step()
            for tensor in self.whole.values():
                tensor.grad = None

        back = [values[gi, piece.param].view(-1)[piece.param_start:piece.param_end]
                for pieces in plan.incoming for gi, _, piece in pieces]
        updated = self._exchange(back, plan.in_numel, plan.out_numel,
                                 "all-to-all of the stepped parameters back to the ranks that hold their pieces")
        self._release()
        del values, gradients, back
        at = 0
        with torch.no_grad():
            for pieces in plan.outgoing:
                for gi, pi, piece in pieces:
                    stepped.tensors[gi][pi].view(-1).copy_(updated[at:at + piece.numel])
                    at += piece.numel
        stepped.write_back()

    # ---- state: torch's layout, by the user's parameter index -------------------------------------

    def _owned_states(self) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        """Each owned parameter (the user's) with the whole tensor its state is keyed by."""
        for (gi, i), tensor in self.whole.items():
            yield self.stepped.groups[gi].params[i], tensor

    def owned_items(self) -> Iterator[tuple[torch.nn.Parameter, dict[str, Any]]]:
        """Each owned parameter with its state (when it has some), for a checkpoint to write whole."""
        for param, tensor in self._owned_states():
            if self.state.get(tensor):
                yield param, self.state[tensor]

    def full_state_dict(self, zopt) -> dict[str, Any]:
        """torch's ``state_dict()`` layout: every parameter's state (CPU tensors) by index, gathered from the
        ranks that own them onto every rank, and the param groups. A collective."""
        index = param_index(zopt)
        mine = {index[param]: {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
                               for k, v in state.items()} for param, state in self.owned_items()}
        merged: dict[int, dict[str, Any]] = {}
        for part in self.comm.all_gather_object(mine):
            merged.update(part)
        return {"state": dict(sorted(merged.items())), "param_groups": param_groups_out(zopt, index)}

    def load_full_state_dict(self, zopt, state_dict: dict[str, Any]) -> None:
        """The inverse of ``full_state_dict`` (from any world size, stage or a DDP run's ``state_dict()``):
        each rank keeps its owned parameters' state; the param groups' settings are the saved ones."""
        saved_id = saved_ids(zopt, state_dict)
        self.state.clear()
        for param, tensor in self._owned_states():
            entry = state_dict["state"].get(saved_id[param])
            if entry:
                self.state[tensor] = {k: _whole(v, tensor.device) for k, v in entry.items()}
        take_settings(zopt, state_dict["param_groups"])


def _whole(value: Any, device: torch.device) -> Any:
    """A state entry as a tensor on ``device``: one read from a checkpoint a range at a time (``read_range``:
    see checkpoint/sharded.py) is read whole."""
    if hasattr(value, "read_range"):
        value = value.read_range(0, value.numel()).reshape(value.shape)
    return value.to(device) if isinstance(value, torch.Tensor) else value
