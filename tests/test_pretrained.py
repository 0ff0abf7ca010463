"""Pretrained weights into the shards (load_pretrained, from_pretrained in the init context) and models
built from a config inside it, against plain torch / DDP on the same seed and data."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from zero_strategy import ZeroConfig
from zero_strategy.engine import Collectives
from zero_strategy.frontend.precision import WorkingPrecision
from zero_strategy.frontend.setup import setup_engine
from zero_strategy.pretrained import PretrainedMismatchError, load_pretrained, sharded_init

from .distributed import run_distributed

transformers = pytest.importorskip("transformers")
STEPS = 4
VOCAB = 64


def _gpt2_config(**extra):
    return transformers.GPT2Config(**{**dict(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                             eos_token_id=0), **extra})


def _bert_config(**extra):
    return transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=64, max_position_embeddings=16, num_labels=3,
                                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **extra)


MODELS = {"gpt2": (lambda: transformers.GPT2LMHeadModel, _gpt2_config),
          "bert": (lambda: transformers.BertForSequenceClassification, _bert_config)}


def _loss(name, model, step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, VOCAB, (2, 12), generator=g)
    if name == "gpt2":
        return model(input_ids=x, labels=x).loss
    return model(input_ids=x, labels=torch.randint(0, 3, (2,), generator=g)).loss


def _save_perturbed(name, path, dtype=torch.float32, **save):
    """A model saved with save_pretrained: random init, then perturbed so that no init equals it."""
    cls, config = MODELS[name]
    torch.manual_seed(7)
    model = cls()(config())
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    model.to(dtype).save_pretrained(path, **save)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    # GPT-2 in several files with an index (tied lm_head saved once), BERT as one bf16 file
    return {"gpt2": str(_save_perturbed("gpt2", root / "gpt2", max_shard_size="40KB")),
            "bert": str(_save_perturbed("bert", root / "bert", dtype=torch.bfloat16))}


def _train(name, model, opt, rank, backward=torch.Tensor.backward):
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = _loss(name, model, step, rank)
        backward(loss)
        opt.step()
        losses.append(loss.item())
    return losses


def _zero_run(name, path, stage, entry, rank):
    cls, config = MODELS[name]
    torch.manual_seed(3)  # an init that differs from the checkpoint's, so that a weight not loaded shows
    if entry == "from_pretrained":  # stages 1-2: as a plain loop opening the context itself builds it
        with sharded_init():
            model = cls().from_pretrained(path, dtype=torch.float32)
        model.train()
    elif entry == "before_setup" and stage == 3:
        with sharded_init():
            model = cls()(config())
        load_pretrained(model, path)
    else:
        model = cls()(config())
        if entry == "before_setup":
            load_pretrained(model, path)
    zero = ZeroConfig(stage=stage, param_persistence_threshold=0, bucket_cap_mb=0.01)
    engine = setup_engine(model, zero, WorkingPrecision(), Collectives(), torch.device("cpu"),
                          lambda: [torch.optim.AdamW(model.parameters(), lr=1e-3)])
    if entry == "after_setup":
        load_pretrained(model, path)
    sharded = stage < 3 or all(p.numel() == 0 for u in engine.sharder.units for g in u.groups for p in g.params)
    return _train(name, model, engine.optimizers[0], rank), sharded


def _load_and_train(rank, world_size, checkpoints):
    out = {}
    for name, path in checkpoints.items():
        cls = MODELS[name][0]()
        reference = cls.from_pretrained(path, dtype=torch.float32)  # plain transformers, whole
        reference.train()
        ddp = DistributedDataParallel(reference)
        out[(name, "ddp")] = _train(name, ddp, torch.optim.AdamW(reference.parameters(), lr=1e-3), rank)
        for stage in (1, 2, 3):
            for entry in ("before_setup", "after_setup", "from_pretrained"):
                out[(name, stage, entry)] = _zero_run(name, path, stage, entry, rank)
    return out


@pytest.mark.timeout(240)
def test_pretrained_weights_load_into_shards_and_train_as_ddp(checkpoints):
    for out in run_distributed(_load_and_train, 2, checkpoints):
        for key, value in out.items():
            if key[1] == "ddp":
                continue
            losses, sharded = value
            want = out[(key[0], "ddp")]
            assert sharded, key
            # the first loss is the pretrained model's on this rank's batch; the steps follow DDP's
            assert losses[0] == pytest.approx(want[0], rel=1e-6), key
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=0, msg=str(key))


def test_a_mismatch_is_refused_before_anything_is_loaded(checkpoints):
    cls = transformers.GPT2LMHeadModel
    for config, says in ((_gpt2_config(n_layer=3), "missing from the checkpoint: ['transformer.h.2."),
                         (_gpt2_config(n_positions=32), "wrongly shaped: ['transformer.wpe.weight: checkpoint (16, 32) "
                                                        "vs model (32, 32)']")):
        model = cls(config)
        before = copy.deepcopy(model.state_dict())
        with pytest.raises(PretrainedMismatchError, match="nothing was loaded") as refused:
            load_pretrained(model, checkpoints["gpt2"])
        assert says in str(refused.value)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    model = cls(_gpt2_config(n_layer=3))  # strict=False loads what matches, and says what did not
    with pytest.warns(UserWarning, match="keys of the model are not in the checkpoint"):
        plan = load_pretrained(model, checkpoints["gpt2"], strict=False)
    assert plan.missing and not plan.unexpected
    reference = cls.from_pretrained(checkpoints["gpt2"])
    assert torch.equal(model.transformer.h[1].mlp.c_fc.weight, reference.transformer.h[1].mlp.c_fc.weight)
    with pytest.raises(PretrainedMismatchError, match="unexpected"):  # a prefix the module's names lack
        load_pretrained(cls(_gpt2_config()), checkpoints["gpt2"], prefix="model.")


# ---- built from a config inside the init context: the eager build, bit for bit ------------------


def _arch(name):
    tf = transformers
    small = dict(vocab_size=VOCAB)
    if name == "gpt2":
        return tf.GPT2LMHeadModel(_gpt2_config())
    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                  num_attention_heads=2, num_key_value_heads=1,
                                                  max_position_embeddings=16, **small))
    if name == "bart":
        return tf.BartForConditionalGeneration(tf.BartConfig(
            d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
            encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=16, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, **small))
    if name == "t5":
        return tf.T5ForConditionalGeneration(tf.T5Config(d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                                                         dropout_rate=0.0, decoder_start_token_id=0, **small))
    return tf.ViTForImageClassification(tf.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                     intermediate_size=64, image_size=16, patch_size=4, num_labels=3,
                                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _arch_loss(name, model, step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    if name == "vit":
        return model(pixel_values=torch.randn(2, 3, 16, 16, generator=g), labels=torch.randint(0, 3, (2,), generator=g)).loss
    x = torch.randint(3, VOCAB, (2, 12), generator=g)
    if name in ("bart", "t5"):
        return model(input_ids=x, labels=x.flip(1)).loss
    return model(input_ids=x, labels=x).loss


ARCHS = ("gpt2", "llama", "bart", "t5", "vit")


def _built_from_config(rank, world_size):
    out = {}
    for name in ARCHS:
        torch.manual_seed(0)
        eager = _arch(name)
        want = {**eager.state_dict(), **dict(eager.named_buffers())}
        torch.manual_seed(0)
        with sharded_init():
            model = _arch(name)
        on_meta = all(t.is_meta for t in [*model.parameters(), *model.buffers()])
        engine = setup_engine(model, ZeroConfig(stage=3, param_persistence_threshold=0), WorkingPrecision(),
                              Collectives(), torch.device("cpu"), lambda: [torch.optim.AdamW(model.parameters(), lr=1e-3)])
        got = {**engine.sharder.full_state_dict(), **dict(model.named_buffers())}
        differ = sorted(k for k in want if not torch.equal(want[k], got[k]))
        ddp = DistributedDataParallel(eager)
        reference = _train_arch(name, ddp, torch.optim.AdamW(eager.parameters(), lr=1e-3), rank)
        out[name] = (on_meta, sorted(want) == sorted(got), differ, _train_arch(name, model, engine.optimizers[0], rank),
                     reference)
    return out


def _train_arch(name, model, opt, rank):
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = _arch_loss(name, model, step, rank)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.timeout(240)
def test_models_built_from_configs_at_stage_3_equal_their_eager_build_and_train_as_ddp():
    for out in run_distributed(_built_from_config, 2):
        for name, (on_meta, same_keys, differ, losses, reference) in out.items():
            assert on_meta and same_keys, name
            assert differ == [], f"{name}: {differ[:5]} differ from the eager build"  # weights and buffers
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-6, atol=0, msg=name)


# ---- the ways users try: from_pretrained in configure_model, init_module, load_raw ---------------


def _front_ends(rank, world_size, path):
    import os

    import lightning as L

    from zero_strategy import ZeroStrategy
    from zero_strategy.fabric import ZeroFabricStrategy

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # processes exist already, as under torchrun
    cls = transformers.GPT2LMHeadModel

    class FineTune(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.losses: list[float] = []

        def configure_model(self) -> None:
            if not hasattr(self, "model"):
                self.model = cls.from_pretrained(path)
                self.model.train()

        def training_step(self, batch, batch_idx):
            loss = _loss("gpt2", self.model, batch_idx, self.global_rank)
            self.losses.append(loss.item())
            return loss

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.zeros(STEPS * world_size, 1), batch_size=1)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    out = {}
    for stage in (1, 2, 3):
        module = FineTune()
        trainer = L.Trainer(strategy=ZeroStrategy(stage=stage, param_persistence_threshold=0), accelerator="cpu",
                            devices=world_size, max_steps=STEPS, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module)
        out[("trainer", stage)] = module.losses

        fabric = L.Fabric(strategy=ZeroFabricStrategy(stage=stage, param_persistence_threshold=0), accelerator="cpu",
                          devices=world_size)
        fabric.launch()
        with fabric.init_module(empty_init=True):  # the Auto class, as most fine-tuning scripts write it
            model = transformers.AutoModelForCausalLM.from_pretrained(path)
        model.train()
        on_meta = all(p.is_meta for p in model.parameters())
        model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        out[("init_module", stage)] = (on_meta, _train("gpt2", model, opt, rank, fabric.backward))
        if stage == 3:  # load_raw into a model set up already: each rank reads its slices
            torch.manual_seed(5)
            model = cls(_gpt2_config())
            model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
            fabric.load_raw(path, model)
            out[("load_raw", stage)] = _train("gpt2", model, opt, rank, fabric.backward)
    # a DeepSpeed script: from_pretrained inside zero.Init, then initialize (each rank reads its ranges)
    import zero_strategy as deepspeed

    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
                 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = cls.from_pretrained(path)
    model.train()
    on_meta = all(p.is_meta for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config,
                                           optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    losses = []
    for step in range(STEPS):
        loss = _loss("gpt2", engine, step, rank)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    out[("zero.Init", 3)] = (on_meta, losses)
    reference = cls.from_pretrained(path)
    reference.train()
    out["ddp"] = _train("gpt2", DistributedDataParallel(reference), torch.optim.AdamW(reference.parameters(), lr=1e-3),
                        rank)
    return out


@pytest.mark.timeout(300)
def test_from_pretrained_in_configure_model_init_module_zero_init_and_load_raw_train_as_ddp(checkpoints):
    for out in run_distributed(_front_ends, 2, checkpoints["gpt2"]):
        want = torch.tensor(out.pop("ddp"))
        for key, got in out.items():
            if key[0] in ("init_module", "zero.Init"):
                on_meta, got = got
                assert on_meta == (key[1] == 3), key
            assert got[0] == pytest.approx(want[0].item(), rel=1e-6), key
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=0, msg=str(key))


# ---- LoRA on a pretrained base: the frozen base sharded, only the adapters with optimizer state -----


def _lora(model, checkpointing):
    import peft

    if checkpointing:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"],
                                                      lora_dropout=0.0, fan_in_fan_out=True))


def _lora_runs(rank, world_size, path):
    from zero_strategy import memory_stats

    cls = transformers.GPT2LMHeadModel
    out = {}
    torch.manual_seed(9)
    reference = _lora(cls.from_pretrained(path), checkpointing=False)
    reference.train()
    adapters = sum(p.numel() for p in reference.parameters() if p.requires_grad)
    total = sum(p.numel() for p in reference.parameters())
    out["ddp"] = _train("gpt2", DistributedDataParallel(reference),
                        torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2), rank)
    for stage in (1, 2, 3):
        for checkpointing in (False, True):
            torch.manual_seed(9)
            with sharded_init() if stage == 3 else contextlib.nullcontext():
                model = _lora(cls.from_pretrained(path), checkpointing)
            model.train()
            engine = setup_engine(model, ZeroConfig(stage=stage, param_persistence_threshold=0), WorkingPrecision(),
                                  Collectives(), torch.device("cpu"),
                                  lambda: [torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                                             lr=1e-2)])
            losses = _train("gpt2", model, engine.optimizers[0], rank)
            out[(stage, checkpointing)] = (losses, memory_stats(model, engine.optimizers))
    return out, adapters, total


@pytest.mark.timeout(300)
def test_lora_on_a_pretrained_base_trains_as_ddp_at_every_stage(checkpoints):
    pytest.importorskip("peft")
    from zero_strategy import estimate_memory

    for out, adapters, total in run_distributed(_lora_runs, 2, checkpoints["gpt2"]):
        want = torch.tensor(out.pop("ddp"))
        for (stage, checkpointing), (losses, memory) in out.items():
            torch.testing.assert_close(torch.tensor(losses), want, rtol=1e-5, atol=0, msg=str((stage, checkpointing)))
            # only the adapters carry Adam's two fp32 states, each rank a half (+ step counts and padding)
            expect = estimate_memory(total, stage=stage, world_size=2, trainable_params=adapters)
            assert expect["optimizer_states"] == 8 * adapters // 2
            assert expect["optimizer_states"] <= memory["optimizer_states"] <= expect["optimizer_states"] * 1.1 + 1024
            if stage == 3:  # the frozen base is sharded like the rest: half of every weight on each rank
                assert expect["params"] <= memory["params"] <= expect["params"] * 1.05 + 4096, (memory, expect)


# ---- every rank intercepts from_pretrained, whatever it imported before --------------------------


FIRST_IMPORT_INSIDE = """
import sys
from zero_strategy.pretrained import sharded_init
from zero_strategy.engine.params.materialize import _param_sources
assert "transformers.modeling_utils" not in sys.modules
with sharded_init():
    from transformers import GPT2LMHeadModel  # first imported here, as in a configure_model
    model = GPT2LMHeadModel.from_pretrained(sys.argv[1])
params = list(model.parameters())
assert all(p.is_meta for p in params) and all(p in _param_sources for p in params), "loaded whole"
assert GPT2LMHeadModel.from_pretrained.__func__.__module__.startswith("transformers"), "left patched"
print("streamed", len(params))
"""


@pytest.mark.timeout(120)
def test_from_pretrained_is_intercepted_when_transformers_is_first_imported_inside(checkpoints):
    """A configure_model that imports transformers itself: intercepted as when it was imported before.
    (Before, only ranks that had imported it did, and the ranks' stage-3 setups paired up wrongly:
    NaN losses on a real fine-tune.)"""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", FIRST_IMPORT_INSIDE, checkpoints["gpt2"]], capture_output=True,
                          text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "streamed" in proc.stdout


def _built_two_ways(rank, world_size):
    """Rank 0 builds on meta (inside the init context), rank 1 eagerly: both refuse, naming the cause."""
    context = sharded_init() if rank == 0 else contextlib.nullcontext()
    torch.manual_seed(0)
    with context:
        model = transformers.GPT2LMHeadModel(_gpt2_config())
    config = ZeroConfig(stage=3, param_persistence_threshold=0)
    try:
        setup_engine(model, config, WorkingPrecision(), Collectives(), torch.device("cpu"),
                     lambda: [torch.optim.SGD(model.parameters(), lr=0.1)])
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.timeout(120)
def test_ranks_that_build_the_model_in_different_ways_are_refused():
    for message in run_distributed(_built_two_ways, 2):
        assert message is not None and "parameters on the meta device (" in message and "on rank" in message
        assert "Build it the same way on every rank" in message
