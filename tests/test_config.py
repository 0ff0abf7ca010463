"""ZeroConfig validation and the optimizer checks ZeroOptimizer makes at construction.

Single process, no process group: ``Collectives`` then has world size 1 and rank 0.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings

import pytest
import torch
from torch import nn

from zero_strategy.config import SUPPORTED_STAGES, ZeroConfig
from zero_strategy.engine import ELEMENTWISE_OPTIMIZERS, Collectives, ZeroOptimizer, check_optimizer_supported
from zero_strategy.engine.optim.checks import WHOLE_PARAMETER_OPTIMIZERS

ALLOWED = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS + WHOLE_PARAMETER_OPTIMIZERS)


# ---- ZeroConfig ----------------------------------------------------------------------------


def test_defaults():
    cfg = ZeroConfig()
    assert cfg.stage == 2
    assert cfg.bucket_cap_mb == 25.0
    assert cfg.allow_untested_optimizer is False
    assert cfg.broadcast_buffers is True  # DDP's default
    assert SUPPORTED_STAGES == (1, 2, 3)
    with pytest.raises(ValueError, match=r"broadcast_buffers='no' must be True \(rank 0's buffers .*\) or False"):
        ZeroConfig(broadcast_buffers="no")


@pytest.mark.parametrize("stage", (1, 2))
@pytest.mark.parametrize("cap", (25.0, 25, 1, 0.5, 1e-6, 1e4))
def test_valid_configs_accepted(stage, cap):
    cfg = ZeroConfig(stage=stage, bucket_cap_mb=cap, allow_untested_optimizer=True)
    assert (cfg.stage, cfg.bucket_cap_mb, cfg.allow_untested_optimizer) == (stage, cap, True)


@pytest.mark.parametrize("stage", (0, 4, -1, "2", 2.0, True, False, None))
def test_bad_stage_rejected(stage):
    with pytest.raises(ValueError, match=rf"stage={re.escape(repr(stage))} is not supported") as info:
        ZeroConfig(stage=stage)
    # the message lists the allowed stages
    assert "(1, 2, 3)" in str(info.value)


@pytest.mark.parametrize("cap", (0, 0.0, -1, -0.5, math.nan, math.inf, -math.inf, "25", True, False, None))
def test_bad_bucket_cap_rejected(cap):
    with pytest.raises(ValueError, match=rf"bucket_cap_mb={re.escape(repr(cap))} must be a positive, finite"):
        ZeroConfig(bucket_cap_mb=cap)


def test_config_is_frozen_and_replace_revalidates():
    cfg = ZeroConfig(stage=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.stage = 3  # type: ignore[misc]
    assert dataclasses.replace(cfg, stage=2).stage == 2
    with pytest.raises(ValueError, match="stage=4"):
        dataclasses.replace(cfg, stage=4)
    with pytest.raises(ValueError, match="bucket_cap_mb=-2"):
        dataclasses.replace(cfg, bucket_cap_mb=-2)


def test_bucket_numel():
    cfg = ZeroConfig(bucket_cap_mb=25)
    assert cfg.bucket_numel(4) == 25 * 2**20 // 4 == 6_553_600
    assert cfg.bucket_numel(2) == 13_107_200
    assert cfg.bucket_numel(8) == 3_276_800
    assert cfg.bucket_numel(1) == 25 * 2**20
    # a bucket of exactly 200 fp32 elements, as the parity tests use
    assert ZeroConfig(bucket_cap_mb=200 * 4 / 2**20).bucket_numel(4) == 200
    assert ZeroConfig(bucket_cap_mb=0.5).bucket_numel(4) == 2**17
    # a fraction of an element truncates down, but never below one element
    assert ZeroConfig(bucket_cap_mb=10 / 2**20).bucket_numel(4) == 2
    assert ZeroConfig(bucket_cap_mb=1e-12).bucket_numel(4) == 1
    assert ZeroConfig(bucket_cap_mb=1e-12).bucket_numel(8) == 1
    for cap in (1e-6, 0.1, 1, 3.7, 25, 1000):
        for size in (1, 2, 4, 8):
            n = ZeroConfig(bucket_cap_mb=cap).bucket_numel(size)
            assert isinstance(n, int) and n >= 1
            assert n * size <= max(cap * 2**20, size)  # never more bytes than the cap
            assert (n + 1) * size > cap * 2**20  # and as many elements as fit


# ---- optimizer checks ----------------------------------------------------------------------


def _params(*shapes, dtype=torch.float32):
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(*s, dtype=dtype)) for s in shapes]


def _zero(optimizer, config=None):
    assert Collectives().world_size == 1  # no process group in these tests
    opt = ZeroOptimizer(optimizer, config)
    opt.remove_hooks()
    return opt


REFUSED = {  # the optimizers no sharding keeps exact: what the refusal must say (why, and what to use)
    "LBFGS": (torch.optim.LBFGS, "closure", "train it with DDP"),
    "SparseAdam": (torch.optim.SparseAdam, "sparse gradients", "use dense embeddings with Adam or AdamW"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_optimizers_that_no_sharding_keeps_exact_are_refused_saying_why_and_what_to_use(name):
    cls, why, instead = REFUSED[name]
    params = _params((4, 3), (3, 5))
    before = [(p.data_ptr(), p.detach().clone()) for p in params]
    with pytest.raises(ValueError, match=rf"^{name} cannot be trained under ZeRO: ") as info:
        _zero(cls(params, lr=0.01))
    assert why in str(info.value) and instead in str(info.value)
    # refused before anything was flattened
    for p, (ptr, value) in zip(params, before):
        assert p.data_ptr() == ptr and torch.equal(p, value)


def test_subclass_of_a_refused_optimizer_is_refused():
    class MyLBFGS(torch.optim.LBFGS):
        pass

    with pytest.raises(ValueError, match=r"^MyLBFGS cannot be trained under ZeRO: it keeps a curvature history"):
        _zero(MyLBFGS(_params((3,))))
    # even when untested optimizers are allowed, or whole parameters asked for: no sharding keeps it exact
    for config in (ZeroConfig(allow_untested_optimizer=True), ZeroConfig(whole_parameter_step=True)):
        with pytest.raises(ValueError, match=r"^MyLBFGS cannot be trained under ZeRO"):
            _zero(MyLBFGS(_params((3,))), config)


def test_whole_parameter_optimizers_refuse_the_steps_that_update_flat_shards():
    for options in ({"offload_optimizer": True}, {"optimizer_state_dtype": "bf16"}):
        with pytest.raises(ValueError, match=r"^Adafactor is stepped whole, each parameter on one rank, which does not "
                                             rf"combine with {next(iter(options))}"):
            _zero(torch.optim.Adafactor(_params((4, 3))), ZeroConfig(**options))


class MyElementwiseSGD(torch.optim.Optimizer):
    """Plain SGD written from scratch: elementwise, but not in the allow-list."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def test_untested_optimizer_rejected_by_default():
    params = _params((4, 3))
    with pytest.raises(ValueError, match=r"^MyElementwiseSGD has not been verified to be elementwise") as info:
        _zero(MyElementwiseSGD(params))
    msg = str(info.value)
    assert f"Known: {ALLOWED}." in msg
    assert "allow_untested_optimizer=True" in msg and "whole_parameter_step=True" in msg
    with pytest.raises(ValueError, match="MyElementwiseSGD"):
        check_optimizer_supported(MyElementwiseSGD(_params((2,))), ZeroConfig())


def test_untested_optimizer_accepted_when_allowed():
    params = _params((4, 3), (3,))
    expected = [p.detach().clone() for p in params]
    user = MyElementwiseSGD(params, lr=0.5)
    opt = ZeroOptimizer(user, ZeroConfig(allow_untested_optimizer=True))
    assert type(opt.inner) is MyElementwiseSGD
    assert opt.inner.param_groups[0]["lr"] == 0.5
    # it is usable: one step with a gradient of ones gives plain SGD's result
    sum(p.sum() for p in params).backward()
    opt.step()
    opt.remove_hooks()
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach(), e - 0.5)


@pytest.mark.parametrize("cls", ELEMENTWISE_OPTIMIZERS, ids=lambda c: c.__name__)
def test_allow_listed_optimizers_accepted(cls):
    check_optimizer_supported(cls(_params((3,)), lr=0.01), ZeroConfig())
    opt = _zero(cls(_params((4, 3), (5,)), lr=0.01))
    assert type(opt.inner) is cls


def test_subclass_of_adam_accepted():
    class MyAdam(torch.optim.Adam):
        pass

    params = _params((4, 3))
    opt = _zero(MyAdam(params, lr=0.01, betas=(0.8, 0.9)))
    assert type(opt.inner) is MyAdam
    assert opt.inner.defaults["betas"] == (0.8, 0.9)


def test_parameter_listed_twice_across_groups_rejected():
    a, b = _params((4, 3), (2, 5))
    user = torch.optim.SGD([{"params": [a]}, {"params": [b]}], lr=0.1)
    user.param_groups[1]["params"].append(a)  # torch refuses this at construction; sneak it in
    with pytest.raises(ValueError, match=r"shape \(4, 3\) appears twice .*again in group 1"):
        _zero(user)


def test_parameter_listed_twice_in_one_group_rejected():
    (a,) = _params((6,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch only warns about this (for now)
        user = torch.optim.SGD([a, a], lr=0.1)
    with pytest.raises(ValueError, match=r"shape \(6,\) appears twice .*again in group 0"):
        _zero(user)


def test_frozen_duplicate_also_rejected():
    (a,) = _params((6,))
    a.requires_grad_(False)
    user = torch.optim.SGD([{"params": [a]}, {"params": _params((2,))}], lr=0.1)
    user.param_groups[1]["params"].append(a)
    with pytest.raises(ValueError, match="appears twice"):
        _zero(user)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("stage", (1, 2))
def test_low_precision_parameters_get_an_fp32_master_unless_told_not_to(dtype, stage):
    params = _params((4, 3), (5,), dtype=dtype)
    opt = _zero(torch.optim.AdamW(params, lr=0.01), ZeroConfig(stage=stage))
    (group,) = opt.groups
    assert group.dtype == dtype and group.master_shard is not None and group.master_shard.dtype == torch.float32
    torch.testing.assert_close(group.master_shard[:12].to(dtype), params[0].detach().reshape(-1))
    true_half = _zero(torch.optim.AdamW(_params((4, 3), dtype=dtype), lr=0.01),
                      ZeroConfig(stage=stage, master_weights=False))
    assert true_half.groups[0].master_shard is None


def test_frozen_low_precision_parameters_allowed():
    trainable = _params((4, 3))
    frozen = _params((5,), dtype=torch.bfloat16)[0].requires_grad_(False)
    opt = _zero(torch.optim.SGD(trainable + [frozen], lr=0.1))
    assert [g.dtype for g in opt.groups] == [torch.float32]
    assert len(opt.groups[0].params) == len(trainable)
    assert all(a is b for a, b in zip(opt.groups[0].params, trainable))


def _in_buffer(t: torch.Tensor, buffer: torch.Tensor) -> bool:
    lo = buffer.untyped_storage().data_ptr()
    hi = lo + buffer.untyped_storage().nbytes()
    return lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi


def test_frozen_untouched_and_trainable_become_views():
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3), nn.Linear(3, 2))
    model[1].requires_grad_(False)
    params = list(model.parameters())
    frozen = [p for p in params if not p.requires_grad]
    trainable = [p for p in params if p.requires_grad]
    assert len(frozen) == 2 and len(trainable) == 4
    before = {id(p): (p.data_ptr(), p.detach().clone(), p.shape) for p in params}
    frozen_data = [p.data for p in frozen]

    opt = _zero(torch.optim.Adam(model.parameters(), lr=0.01), ZeroConfig(bucket_cap_mb=16 * 4 / 2**20))
    buffers = [g.buffer for g in opt.groups]
    assert len(opt.groups) == 1
    assert len(opt.groups[0].segments) > 1  # a small bucket: several segments

    # the module still holds the very same Parameter objects
    assert all(a is b for a, b in zip(model.parameters(), params))
    for p in frozen:
        ptr, value, shape = before[id(p)]
        assert p.data_ptr() == ptr and p.shape == shape and torch.equal(p, value)
        assert not any(_in_buffer(p, b) for b in buffers)
        assert all(p is not q for g in opt.groups for q in g.params)
    assert all(p.data is d or p.data.data_ptr() == d.data_ptr() for p, d in zip(frozen, frozen_data))
    for p in trainable:
        ptr, value, shape = before[id(p)]
        assert _in_buffer(p, opt.groups[0].buffer)
        assert p.data_ptr() != ptr  # moved into the flat buffer ...
        assert p.shape == shape and torch.equal(p, value)  # ... with its shape and values
        assert p.is_contiguous()
        index = next(i for i, q in enumerate(opt.groups[0].params) if q is p)
        off = opt.groups[0].layout.param_offsets[index]
        assert p.data_ptr() == opt.groups[0].buffer.data_ptr() + off * p.element_size()
    # writing through the buffer is seen by the parameter: a real view, not a copy
    with torch.no_grad():
        opt.groups[0].buffer.add_(1.0)
    for p in trainable:
        assert torch.equal(p, before[id(p)][1] + 1.0)
    for p in frozen:
        assert torch.equal(p, before[id(p)][1])


def test_float64_and_mixed_dtypes_get_separate_flat_groups():
    f32 = _params((4, 3), (3,))
    f64 = _params((5,), (2, 2), dtype=torch.float64)
    opt = _zero(torch.optim.SGD([{"params": [f32[0], f64[0], f32[1], f64[1]]}], lr=0.1))
    assert [g.dtype for g in opt.groups] == [torch.float32, torch.float64]
    assert [id(p) for p in opt.groups[0].params] == [id(p) for p in f32]
    assert [id(p) for p in opt.groups[1].params] == [id(p) for p in f64]
    assert opt.groups[1].layout.align == 2  # 16 bytes of float64
    for g in opt.groups:
        for p in g.params:
            assert _in_buffer(p, g.buffer) and p.dtype == g.buffer.dtype


def test_stage3_fields():
    cfg = ZeroConfig(stage=3, shard_modules=["Block", torch.nn.Linear])
    assert cfg.shard_modules == ("Block", torch.nn.Linear)  # a list from Hydra becomes a tuple
    for field in ("shard_modules", "activation_checkpointing"):  # a bare string is not split into letters
        with pytest.raises(ValueError, match=rf"{field}='Block' must be a list .* write {field}=\['Block'\]"):
            ZeroConfig(stage=3, **{field: "Block"})
        with pytest.raises(ValueError, match=rf"{field}=<class 'torch.nn.modules.linear.Linear'> must be a list"):
            ZeroConfig(stage=3, **{field: torch.nn.Linear})
    with pytest.raises(ValueError, match=r"shard_modules holds \[3\]"):
        ZeroConfig(stage=3, shard_modules=(3,))
    with pytest.raises(ValueError, match=r"param_persistence_threshold=-1 must be a non-negative integer"):
        ZeroConfig(stage=3, param_persistence_threshold=-1)
    with pytest.raises(ValueError, match=r"unit_params=1.5"):
        ZeroConfig(stage=3, unit_params=1.5)
    with pytest.raises(ValueError, match=r"collective_timeout=0 must be a positive number of seconds"):
        ZeroConfig(collective_timeout=0)
    with pytest.raises(ValueError, match=r"check_unit_order='yes' must be True or False"):
        ZeroConfig(check_unit_order="yes")
    for name in ("allow_untested_optimizer", "whole_parameter_step"):
        with pytest.raises(ValueError, match=rf"{name}='yes' must be True or False"):
            ZeroConfig(**{name: "yes"})


def test_every_front_end_takes_every_engine_setting_with_its_default():
    # ZeroStrategy and ZeroFabricStrategy spell ZeroConfig's fields out in their signatures (for IDEs,
    # help() and zero-train's checks): a field added to ZeroConfig must be added to both, same default
    import dataclasses
    import inspect

    from zero_strategy import ZeroFabricStrategy, ZeroStrategy

    # a field with argument=False is set from elsewhere (master_weights and the low-precision reductions'
    # dtype follow the precision plugin: frontend/setup.py's engine_config), not taken as an argument
    fields = {f.name: f.default for f in dataclasses.fields(ZeroConfig) if f.metadata.get("argument", True)}
    assert "master_weights" not in fields
    for front_end in (ZeroStrategy, ZeroFabricStrategy):
        params = inspect.signature(front_end.__init__).parameters
        missing = set(fields) - set(params)
        assert not missing, f"{front_end.__name__} lacks {sorted(missing)}"
        for name, default in fields.items():
            given = params[name].default
            assert given == default or (given == () and default in ((), None)), (front_end.__name__, name)
    strategy = ZeroStrategy(stage=3, quantized_weights=True, secondary_partition_size=2, collective_timeout=30.0)
    assert (strategy.config.quantized_weights, strategy.config.secondary_partition_size,
            strategy.config.collective_timeout) == (True, 2, 30.0)


def test_cpu_mmap_threshold_is_checked():
    for bad in (0, 1e-7, 0.1, -1, 33, True, "4", float("nan")):
        with pytest.raises(ValueError, match=f"cpu_mmap_threshold_mb={bad!r} must be a number of MiB from 0.125"):
            ZeroConfig(cpu_mmap_threshold_mb=bad)
    assert ZeroConfig(cpu_mmap_threshold_mb=None).cpu_mmap_threshold_mb is None
