"""Stage 3 against DDP, 2 gloo processes, fp32, same seed and data: losses and parameters."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from zero_strategy.config import ZeroConfig
from zero_strategy.engine import ZeroOptimizer, shard_module

from .distributed import run_distributed
from .models import OddMLP, batch, make_optimizer, param_groups

STEPS = 10


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 2 * d)
        self.proj = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.norm(x))))


class TinyLM(nn.Module):
    """Tied input/output embeddings, a block called twice per forward, a dict output."""

    def __init__(self, vocab: int = 37, d: int = 12, n_blocks: int = 3) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, idx, step=0, rank=0):
        h = self.wte(idx)  # (B, T, C)
        for block in self.blocks:
            h = block(h)
        h = self.blocks[0](h)  # the first block again
        return {"logits": self.lm_head(self.norm(h))}  # (B, T, vocab)


def _lm_batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(0, 37, (4, 9), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _lm_loss(model, step, rank):
    x, y = _lm_batch(step, rank)
    return F.cross_entropy(model(x)["logits"].reshape(-1, 37), y.reshape(-1))


def _mlp_loss(model, step, rank):
    x, y = batch(step, rank)
    return F.mse_loss(model(x, step, 0), y)  # every rank runs the same modules at stage 3


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=37, n_positions=16, n_embd=24, n_layer=3, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)  # random init; lm_head is tied to the token embedding


def _gpt2_loss(model, step, rank):
    x, _ = _lm_batch(step, rank)
    return model(input_ids=x, labels=x).loss


# Models whose layers are over the default param_persistence_threshold (100k elements), so that
# ZeroConfig(stage=3) with nothing else has something to shard: the defaults as users meet them.
def _gpt2_default_sized():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=512, n_positions=16, n_embd=256, n_layer=3, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)  # 2.5M parameters; lm_head tied to the token embedding


def _gpt2_default_loss(model, step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, 512, (2, 12), generator=g)
    return model(input_ids=x, labels=x).loss


def _bert_default_sized():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=512, hidden_size=384, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=1536, max_position_embeddings=16, num_labels=3,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config)  # 3.9M parameters


def _bert_default_loss(model, step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randint(0, 512, (2, 12), generator=g), torch.randint(0, 3, (2,), generator=g)
    return model(input_ids=x, labels=y).loss


class _AdapterBlock(nn.Module):
    """A frozen base layer beside a trainable low-rank adapter (LoRA's pattern): backward needs the
    frozen weight for the input's gradient after the adapter's gradients are in."""

    def __init__(self, d: int = 32, r: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(d, d).requires_grad_(False)
        self.a = nn.Linear(d, r, bias=False)
        self.b = nn.Linear(r, d, bias=False)

    def forward(self, x):
        return x + torch.tanh(self.base(x) + self.b(self.a(x)))


class _AdaptedOuter(nn.Module):
    """A unit whose output is that of the adapter unit inside it: one tensor, two units' hooks."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.inner = _AdapterBlock(d)

    def forward(self, x):
        return self.inner(torch.tanh(self.fc(x)))


def _adapters():
    return nn.Sequential(nn.Linear(8, 32), *[_AdapterBlock() for _ in range(3)], nn.Linear(32, 8))


def _nested_adapters():
    return nn.Sequential(nn.Linear(8, 32), *[_AdaptedOuter() for _ in range(2)], nn.Linear(32, 8))


def _adapters_loss(model, step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return F.mse_loss(model(torch.randn(4, 8, generator=g)), torch.randn(4, 8, generator=g))


CASES = {
    # name: (model factory, loss, optimizer groups, config)
    "mlp-linear-units": (OddMLP, _mlp_loss, param_groups,
                         ZeroConfig(stage=3, shard_modules=("Linear",), param_persistence_threshold=0)),
    "mlp-by-size": (OddMLP, _mlp_loss, param_groups,
                    ZeroConfig(stage=3, unit_params=250, param_persistence_threshold=8)),  # units of 1-2 Linears
    "lm-blocks": (TinyLM, _lm_loss, lambda m: m.parameters(),
                  ZeroConfig(stage=3, shard_modules=("Block",), param_persistence_threshold=13)),
    "lm-no-prefetch": (TinyLM, _lm_loss, lambda m: m.parameters(),
                       ZeroConfig(stage=3, shard_modules=(Block,), param_persistence_threshold=0, prefetch=False)),
    "transformers-gpt2": (_gpt2, _gpt2_loss, lambda m: m.parameters(),
                          ZeroConfig(stage=3, shard_modules=("GPT2Block",), param_persistence_threshold=0)),
    "gpt2-defaults": (_gpt2_default_sized, _gpt2_default_loss, lambda m: m.parameters(), ZeroConfig(stage=3)),
    "bert-defaults": (_bert_default_sized, _bert_default_loss, lambda m: m.parameters(), ZeroConfig(stage=3)),
    "frozen-base-adapters": (_adapters, _adapters_loss, lambda m: [p for p in m.parameters() if p.requires_grad],
                             ZeroConfig(stage=3, shard_modules=("_AdapterBlock",), param_persistence_threshold=0)),
    "nested-frozen-adapters": (_nested_adapters, _adapters_loss, lambda m: [p for p in m.parameters() if p.requires_grad],
                               ZeroConfig(stage=3, shard_modules=("_AdaptedOuter", "_AdapterBlock"),
                                          param_persistence_threshold=0)),
}
DEFAULT_CASES = ("gpt2-defaults", "bert-defaults")


def _stage3_vs_ddp(rank, world_size, case, optimizer):
    factory, loss_fn, groups, config = CASES[case]
    torch.manual_seed(0)
    model = factory()
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(reference, find_unused_parameters=True)
    ddp_opt = make_optimizer(optimizer, groups(reference))
    user_opt = make_optimizer(optimizer, groups(model))  # before sharding: groups look at p.dim()
    sharder = shard_module(model, config)
    opt = ZeroOptimizer(user_opt, config, sharder=sharder)
    released = all(p.numel() == 0 for u in sharder.units for g in u.groups for p in g.params)

    losses, ref_losses = [], []
    for step in range(STEPS):
        for m, o, out in ((ddp, ddp_opt, ref_losses), (model, opt, losses)):
            o.zero_grad()
            loss = loss_fn(m, step, rank)
            loss.backward()
            o.step()
            out.append(loss.item())
        if step % 4 == 3:  # evaluation between steps, under no_grad
            with torch.no_grad():
                losses.append(loss_fn(model, 999, rank).item())
                ref_losses.append(loss_fn(reference, 999, rank).item())
    from zero_strategy import gathered_parameters

    from zero_strategy import count_parameters, memory_stats

    memory = (memory_stats(model, [opt])["total"], count_parameters(model), len(sharder.units))
    with gathered_parameters(model):
        params = {n: (p.detach().clone(), q.detach().clone())
                  for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters())}
    return losses, ref_losses, params, released, memory


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_stage3_matches_ddp(case, optimizer):
    from zero_strategy import estimate_memory

    for losses, ref_losses, params, released, (total, numel, units) in run_distributed(_stage3_vs_ddp, 2, case,
                                                                                         optimizer):
        assert released, "unit parameters should be empty between steps"
        if case in DEFAULT_CASES and optimizer == "adam":  # the defaults shard: 16 bytes per parameter / N
            assert units >= 6
            formula = estimate_memory(numel, stage=3, world_size=2)["total"]
            assert formula <= total <= 1.10 * formula, f"{total / formula:.3f} x the formula"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
        for name, (p, q) in params.items():
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _edit_under_gathered_parameters(rank, world_size):
    from zero_strategy import gathered_parameters

    torch.manual_seed(0)
    model = TinyLM()
    config = ZeroConfig(stage=3, shard_modules=("Block",), param_persistence_threshold=13)
    sharder = shard_module(model, config)
    proj = model.blocks[1].proj.weight  # sharded: empty outside the block
    norm = model.norm.weight  # 12 elements: resident, whole everywhere
    seen = {"outside": tuple(proj.shape)}
    with gathered_parameters([proj, norm]), torch.no_grad():
        seen["inside"] = tuple(proj.shape)
        original = proj.detach().clone()
        proj.fill_(float(rank + 1))  # no modifier: discarded
    with gathered_parameters([proj]):
        seen["discarded"] = torch.equal(proj, original)
    with gathered_parameters(model, modifier_rank=1), torch.no_grad():
        proj.fill_(float(10 * (rank + 1)))
        norm.fill_(float(10 * (rank + 1)))
    with gathered_parameters(model.blocks[1]):
        seen["proj"] = proj.detach().clone()
    seen["norm"] = norm.detach().clone()
    seen["released_again"] = tuple(proj.shape)
    seen["state"] = sharder.full_state_dict()["blocks.1.proj.weight"]
    return seen


@pytest.mark.timeout(120)
def test_gathered_parameters_gives_full_parameters_and_keeps_the_modifiers_edits():
    for seen in run_distributed(_edit_under_gathered_parameters, 2):
        assert seen["outside"] == (0,) and seen["released_again"] == (0,)
        assert seen["inside"] == (12, 24) and seen["discarded"]
        assert torch.equal(seen["proj"], torch.full((12, 24), 20.0))  # rank 1's edit, on both ranks
        assert torch.equal(seen["norm"], torch.full((12,), 20.0))
        assert torch.equal(seen["state"], seen["proj"])


def test_a_released_unit_gives_its_buffer_back_while_backward_still_needs_its_weights():
    # autograd keeps a view of each Linear's gathered weight for backward; releasing the unit must
    # give its buffer back anyway, the next unit must reuse it (see [Note: saved weights] and
    # [Note: reused buffers]), a user's own saved-tensor hooks must still see the activations, and
    # backward must still be right
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(8)])
    reference = copy.deepcopy(model)
    sharder = shard_module(model, ZeroConfig(stage=3, shard_modules=("Linear",), param_persistence_threshold=0,
                                             prefetch=False))
    sharded = [g for g in sharder.groups if not g.resident]
    assert len(sharded) == 8
    gathered_at = []
    for block in model:  # after the sharder's own hook: the unit is gathered
        block[0].register_forward_pre_hook(lambda m, args: gathered_at.append(m.weight.untyped_storage().data_ptr()))
    x = torch.randn(4, 64)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = model(x).square().mean()
    assert all(g.buffer is None for g in sharded)  # every unit released
    assert len(set(gathered_at)) == 1, "each unit should gather into the buffer the one before gave back"
    unit_bytes = sharded[0].layout.numel * 4
    assert sum(b.numel() * b.element_size() for b in sharder.workspace_tensors()) == unit_bytes
    assert saved and not any(t.untyped_storage().data_ptr() in gathered_at for t in saved)  # activations only
    grads = {}
    for g in sharded:
        for p in g.params:
            p.register_post_accumulate_grad_hook(lambda p, g=g: grads.__setitem__(p, p.grad.clone()))
    loss.backward()
    reference(x).square().mean().backward()
    names = {p: n for n, p in model.named_parameters()}
    assert len(grads) == 16
    for p, grad in grads.items():
        torch.testing.assert_close(grad.view(-1), reference.get_parameter(names[p]).grad.view(-1), rtol=1e-6, atol=1e-7)


def test_loading_whole_weights_also_sets_the_masters_of_resident_parameters():
    # bf16 at stage 3: biases stay whole (resident) with fp32 masters; a step with lr=0 must keep
    # the loaded values, not write the masters' old ones back
    torch.manual_seed(7)
    want = {k: v.clone() for k, v in nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 8)).to(torch.bfloat16)
            .state_dict().items()}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 8)).to(torch.bfloat16)
    config = ZeroConfig(stage=3, shard_modules=("Linear",), param_persistence_threshold=100)
    sharder = shard_module(model, config)
    assert sharder.resident and all(g.master_shard is not None for g in sharder.resident)
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), config, sharder=sharder)
    sharder.load_full_state_dict(want)
    model(torch.randn(2, 8, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    got = sharder.full_state_dict()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_edits_under_gathered_parameters_are_kept_in_a_world_of_one():
    # no process group: rank 0 is the only rank, and its edits must reach the shards
    from zero_strategy import gathered_parameters

    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    sharder = shard_module(model, ZeroConfig(stage=3, shard_modules=("Linear",), param_persistence_threshold=0))
    with gathered_parameters(model, modifier_rank=0), torch.no_grad():
        model[0].weight.fill_(3.0)
    assert model[0].weight.shape == (0,)  # released again
    assert torch.equal(sharder.full_state_dict()["0.weight"], torch.full((16, 8), 3.0))


def test_an_in_place_change_of_a_tensor_saved_inside_a_unit_is_refused_as_without_zero():
    # the saved-tensor hooks of [Note: saved weights] pack every tensor a unit's forward saves, and
    # autograd skips its own version check for packed tensors: the hooks must check it themselves
    class ExpThenInPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            h = torch.exp(self.fc(x))  # exp saves its output for backward...
            h.add_(1.0)  # ...which is then changed: backward would use the wrong values
            return h

    torch.manual_seed(0)
    model = nn.Sequential(ExpThenInPlace(), ExpThenInPlace())
    plain = copy.deepcopy(model)
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as without_zero:
        plain(x).sum().backward()
    shard_module(model, ZeroConfig(stage=3, shard_modules=("ExpThenInPlace",), param_persistence_threshold=0))
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: \[torch.FloatTensor \[2, 8\]\] is at "
                                           r"version 1; expected version 0 instead \(saved in the forward of a stage-3"):
        model(x).sum().backward()
    assert "is at version 1; expected version 0 instead" in str(without_zero.value)  # the same versions as torch's


def test_a_gather_that_fails_in_a_units_pre_forward_leaves_every_unit_releasable():
    # the post-forward hook runs even when the pre-forward hook raised (always_call): it must not
    # count a forward that never began, or the unit stays gathered and the next steps go wrong
    # (the LayerNorm is the root unit's: the root's post-forward hook must not count it either)
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(64), *[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)])
    reference = copy.deepcopy(model)
    config = ZeroConfig(stage=3, shard_modules=("Linear",), param_persistence_threshold=0, prefetch=False)
    sharder = shard_module(model, config)
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), config, sharder=sharder)
    take, calls = sharder.pool.take, []

    def failing_take(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:  # the third unit's gather (the root's is the first)
            raise torch.OutOfMemoryError("simulated: no memory for the gather buffer")
        return take(*args, **kwargs)

    sharder.pool.take = failing_take
    x = torch.randn(4, 64)
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        model(x).sum().backward()
    assert [u.users for u in sharder.all_units] == [0] * 5
    opt.zero_grad()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        reference(x).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert [u.users for u in sharder.all_units] == [0] * 5 and not [u for u in sharder.all_units if u.has_full_buffers]
    full = sharder.full_state_dict()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=0, atol=1e-6, msg=name)
