"""Optimizer offload's host step started during backward (``offload_overlap``: see [Note: the
overlapped host step] in overlap.py, and [Note: step backends])."""

from __future__ import annotations

from typing import Any, Collection, Optional

import torch

from ..config import ZeroConfig
from .optimizer_checks import ELEMENTWISE_OPTIMIZERS
from .flat import FlatGroup
from .overlap import OverlappedHostStep
from .step_backend import Stepped
from .step_grads import StepGradients
from .step_host import GradOf, HostTilesStep
from .tiled_step import PieceKey


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
