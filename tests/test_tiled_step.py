"""The CPU step in tiles equals the inner optimizer's whole step bit for bit: [Note: the CPU step in tiles]."""

import pytest
import torch

from zero_strategy.engine import ELEMENTWISE_OPTIMIZERS
from zero_strategy.engine.optim.step.torch_step import TorchStep
from zero_strategy.engine.optim.tiles import TiledStep, plan_tiles

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
    stepper = TiledStep(plan_tiles(ranges, 7, split_pieces=True), cls, {}, tiled, offsets)
    assert any(p.start - offsets[p.group][p.piece] > 0 for tile in stepper.tiles for p in tile)  # pieces are cut
    settings = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    for step in range(4):
        grads = {(gi, pi): torch.randn(n) for gi, group in enumerate(sizes) for pi, n in enumerate(group)
                 if not (step == 2 and (gi, pi) == (0, 2))}
        for (gi, pi), g in grads.items():
            whole[gi][pi].grad = g.clone()
        reference.step()
        reference.zero_grad(set_to_none=True)
        stepper.step(grads, inner.state, lambda gi, pi: (user_group[gi][pi], settings[user_group[gi][pi]]))
        for gi, group in enumerate(sizes):
            for pi in range(len(group)):
                assert torch.equal(tiled[gi][pi], whole[gi][pi]), (step, gi, pi)
                mine, theirs = inner.state[tiled[gi][pi]], reference.state[whole[gi][pi]]
                assert mine.keys() == theirs.keys()
                for k, v in theirs.items():
                    assert torch.equal(torch.as_tensor(mine[k]), torch.as_tensor(v)), (step, gi, pi, k)


def _two_steps_then_remove(model: torch.nn.Module, opt: torch.optim.Optimizer, handles: list) -> None:
    try:
        for _ in range(2):
            model(torch.randn(2, 1000)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    finally:
        for h in handles:
            h.remove()


def test_step_hooks_fire_as_in_the_untiled_step():
    """The tiles' scratch optimizers step without hooks; the inner optimizer's step fires them once,
    as when it steps whole (and the engine's own step, an optimizer too, fires the global ones)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from zero_strategy import ZeroConfig, ZeroOptimizer

    def calls_of(tiled: bool) -> list[tuple[str, str]]:
        torch.manual_seed(0)
        model = torch.nn.Linear(1000, 1000)  # a million weights: eight tiles
        opt = ZeroOptimizer(torch.optim.AdamW(model.parameters()), ZeroConfig(stage=1))
        assert len(opt.step_backend.tiled.tiles) == 8
        if not tiled:
            opt.step_backend = TorchStep(opt.step_backend.stepped, opt.config, None)
        calls = []
        who = lambda o: "engine" if o is opt else "inner" if o is opt.inner else "another"  # noqa: E731
        handles = [register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("global pre", who(o)))),
                   register_optimizer_step_post_hook(lambda o, a, k: calls.append(("global post", who(o)))),
                   opt.inner.register_step_pre_hook(lambda o, a, k: calls.append(("inner pre", who(o))))]
        _two_steps_then_remove(model, opt, handles)
        return calls

    tiled = calls_of(True)
    assert tiled == calls_of(False)
    assert tiled.count(("inner pre", "inner")) == 2 and ("global pre", "another") not in tiled


@pytest.mark.parametrize("offload", ["host", "disk"])
def test_an_offloaded_step_fires_the_inner_optimizers_hooks_once(offload, tmp_path):
    """The host step runs tile by tile too (and with disk offload, scratch optimizers): one hooked step."""
    from zero_strategy import ZeroConfig, ZeroOptimizer

    torch.manual_seed(0)
    model = torch.nn.Linear(1000, 1000)
    config = ZeroConfig(stage=1, offload_optimizer=True, offload_tile_mb=1.0,
                        offload_dir=str(tmp_path) if offload == "disk" else None)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters()), config)
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    calls = []
    handle = opt.inner.register_step_pre_hook(lambda o, a, k: calls.append(o is opt.inner))
    other = register_optimizer_step_pre_hook(lambda o, a, k: calls.append("a scratch optimizer")
                                             if o is not opt and o is not opt.inner else None)
    _two_steps_then_remove(model, opt, [handle, other])
    assert calls == [True, True]


class CountingAdam(torch.optim.Adam):
    """A subclass that keeps state on the instance: a scratch optimizer per tile would start it afresh."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.calls = 0

    def step(self, closure=None):
        self.calls += 1
        for group in self.param_groups:
            group["lr"] = 1e-2 * self.calls
        return super().step(closure)


def test_a_subclass_steps_whole_as_torch_does():
    from zero_strategy import ZeroConfig, ZeroOptimizer

    torch.manual_seed(0)
    model, reference = torch.nn.Linear(1000, 300), torch.nn.Linear(1000, 300)
    reference.load_state_dict(model.state_dict())
    opt = ZeroOptimizer(CountingAdam(model.parameters()), ZeroConfig(stage=1))
    plain = CountingAdam(reference.parameters())
    assert type(opt.step_backend) is TorchStep
    for _ in range(3):
        x = torch.randn(2, 1000)
        for m, o in ((model, opt), (reference, plain)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adagrad, torch.optim.SGD], ids=lambda c: c.__name__)
def test_the_engines_tiled_step_equals_its_whole_step(cls):
    """Through ZeroOptimizer (one process): two param groups, an LR scheduler, clipping, and a layer
    without gradients at one step; the tiled engine and the same engine stepping whole
    (the engine's ``TorchStep``) stay bit for bit equal, parameters and state dict."""
    from zero_strategy import ZeroConfig, ZeroOptimizer

    def run(tiled: bool) -> tuple[list[torch.Tensor], dict]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(700, 900), torch.nn.Linear(900, 10))  # 5 tiles
        stateless = {"momentum": 0.0, "nesterov": False} if cls is torch.optim.SGD else {}  # no state: no entry
        groups = [{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.05, **stateless}]
        opt = ZeroOptimizer(cls(groups, **{**SETTINGS[cls], "lr": 0.01}), ZeroConfig(stage=1))
        assert len(opt.step_backend.tiled.tiles) == 5
        if not tiled:
            opt.step_backend = TorchStep(opt.step_backend.stepped, opt.config, None)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for step in range(4):
            x = torch.randn(3, 700, generator=torch.Generator().manual_seed(step))
            loss = model[0](x).square().mean() if step == 1 else model(x).square().mean()  # step 1: no head grads
            loss.backward()
            opt.clip_grad_norm_(0.5)
            opt.step()
            opt.zero_grad()
            sched.step()
        return [p.detach().clone() for p in model.parameters()], opt.state_dict()

    tiled, tiled_state = run(True)
    whole, whole_state = run(False)
    for a, b in zip(tiled, whole):
        assert torch.equal(a, b)
    assert tiled_state["state"].keys() == whole_state["state"].keys()
    for i, entry in whole_state["state"].items():
        assert tiled_state["state"][i].keys() == entry.keys(), i
        for k, v in entry.items():
            assert torch.equal(torch.as_tensor(tiled_state["state"][i][k]), torch.as_tensor(v)), (i, k)
