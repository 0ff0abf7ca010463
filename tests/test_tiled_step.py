"""The CPU step in tiles equals the inner optimizer's whole step bit for bit: [Note: the CPU step in tiles]."""

import pytest
import torch

from zero_strategy.engine import ELEMENTWISE_OPTIMIZERS
from zero_strategy.engine.tiled_step import TiledStep, plan_tiles

SETTINGS = {  # options that give each optimizer its largest state (and a second group's differ)
    torch.optim.SGD: dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
    torch.optim.Adam: dict(lr=1e-2, amsgrad=True, weight_decay=0.1),
    torch.optim.AdamW: dict(lr=1e-2, weight_decay=0.01),
    torch.optim.Adamax: dict(lr=1e-2),
    torch.optim.Adagrad: dict(lr=0.1, lr_decay=0.01),
    torch.optim.RMSprop: dict(lr=1e-2, centered=True, momentum=0.9),
    torch.optim.Adadelta: dict(lr=0.5),
    torch.optim.NAdam: dict(lr=1e-2, decoupled_weight_decay=True, weight_decay=0.01),
    torch.optim.RAdam: dict(lr=1e-2),
    torch.optim.ASGD: dict(lr=1e-2, t0=1),
    torch.optim.Rprop: dict(lr=1e-2),
}


def test_every_elementwise_optimizer_has_settings_here():
    assert set(SETTINGS) == set(ELEMENTWISE_OPTIMIZERS)


@pytest.mark.parametrize("cls", ELEMENTWISE_OPTIMIZERS, ids=lambda c: c.__name__)
def test_tiled_steps_equal_whole_steps(cls):
    """Pieces of odd sizes in two flat groups and two param groups, cut by tiles of 7 elements at odd
    offsets; four steps (the first creates the state), one of them without a gradient for a piece."""
    sizes = [[13, 1, 30], [8, 21]]
    user_group = [[0, 1, 0], [1, 1]]
    torch.manual_seed(0)
    whole = [[torch.randn(n) for n in group] for group in sizes]
    tiled = [[t.clone() for t in group] for group in whole]
    kw = SETTINGS[cls]
    other = {**kw, "lr": kw.get("lr", 1.0) / 3}

    def optimizer(pieces):
        groups = [{"params": [t for gi, g in enumerate(pieces) for pi, t in enumerate(g) if user_group[gi][pi] == u],
                   **hyper} for u, hyper in enumerate((kw, other))]
        return cls(groups)

    reference, inner = optimizer(whole), optimizer(tiled)
    offsets = [[sum(group[:i]) for i in range(len(group))] for group in sizes]
    ranges = [[(o, o + n) for o, n in zip(offs, group)] for offs, group in zip(offsets, sizes)]
    stepper = TiledStep(plan_tiles(ranges, 7, split_pieces=True), cls, {})
    assert any(p.start - offsets[p.group][p.piece] > 0 for tile in stepper.tiles for p in tile)  # pieces are cut
    settings = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    for step in range(4):
        grads = {(gi, pi): torch.randn(n) for gi, group in enumerate(sizes) for pi, n in enumerate(group)
                 if not (step == 2 and (gi, pi) == (0, 2))}
        for (gi, pi), g in grads.items():
            whole[gi][pi].grad = g.clone()
        reference.step()
        reference.zero_grad(set_to_none=True)
        stepper.step(tiled, offsets, grads, inner.state, lambda gi, pi: (user_group[gi][pi], settings[user_group[gi][pi]]))
        for gi, group in enumerate(sizes):
            for pi in range(len(group)):
                assert torch.equal(tiled[gi][pi], whole[gi][pi]), (step, gi, pi)
                mine, theirs = inner.state[tiled[gi][pi]], reference.state[whole[gi][pi]]
                assert mine.keys() == theirs.keys()
                for k, v in theirs.items():
                    assert torch.equal(torch.as_tensor(mine[k]), torch.as_tensor(v)), (step, gi, pi, k)
