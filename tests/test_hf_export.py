"""Export to the Hugging Face layout: ``zero-consolidate --hf``, ``save_pretrained`` from a running job,
and transformers' own ``save_pretrained`` on a stage-3 model.

One 2-rank launch trains two tiny GPT-2s (hidden 32, 2 layers, tied embeddings) at stage 3 through the
engine's front-end door (``setup_engine``, what the Trainer, Fabric and ``initialize`` call): one in
bf16-mixed (so the exports come from the fp32 masters), one a peft LoRA model over a saved
"pretrained" base. Each saves a sharded checkpoint and exports itself live; the checks then run in
this process against the checkpoint's consolidated weights.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from zero_strategy import ZeroConfig  # noqa: E402
from zero_strategy.checkpoint import CheckpointReader  # noqa: E402
from zero_strategy.checkpoint.consolidate import full_state_dict  # noqa: E402
from zero_strategy.checkpoint.hf_layout import parse_size, plan_shards  # noqa: E402
from zero_strategy.cli.consolidate import main as consolidate  # noqa: E402

from .distributed import run_distributed  # noqa: E402

VOCAB, STEPS = 64, 3
GPT2 = dict(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
LORA = dict(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], lora_dropout=0.0)
PROMPT = torch.arange(12).remainder(VOCAB).view(2, 6)


class LitLike(nn.Module):
    """What a LightningModule holds: the transformers (or peft) model under ``self.model``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens).logits


def _train_and_export(model: nn.Module, precision: str, folder: Path, rank: int) -> dict:
    from zero_strategy.engine import Collectives
    from zero_strategy.frontend import WorkingPrecision, save_sharded_model, setup_engine
    from zero_strategy.frontend.pretrained import save_pretrained

    module = LitLike(model)
    config = ZeroConfig(stage=3, shard_modules=("GPT2Block",), param_persistence_threshold=0)
    trainable = [p for p in module.parameters() if p.requires_grad]
    engine = setup_engine(module, config, WorkingPrecision(precision), Collectives(), torch.device("cpu"),
                          [torch.optim.AdamW(trainable, lr=1e-2)])
    generator = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (2, 8), generator=generator)
        engine.sharder.hold_root()
        logits = module(tokens).float()
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        engine.optimizers[0].zero_grad()
        loss.backward()
        engine.optimizers[0].step()
    save_sharded_model(folder / "ckpt", {"optimizer_states": []}, engine)
    save_pretrained(engine, folder / "live")
    hf = module.model
    refused = ""
    try:  # on one rank, as `if rank == 0: model.save_pretrained(dir)`: refused at once, nothing written
        hf.save_pretrained(folder / f"refused{rank}")
    except RuntimeError as err:
        refused = str(err)
    hf.save_pretrained(folder / "own", is_main_process=rank == 0)  # transformers' way on every rank
    module.eval()
    with torch.no_grad():
        engine.sharder.hold_root()
        logits = module(PROMPT).float()
        engine.sharder.release_root()
    return {"refused": refused, "refused_wrote": (folder / f"refused{rank}").exists(), "logits": logits}


def _tokens(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(10 * step + rank))


def _front_ends(rank: int, folder: Path) -> dict:
    """Each front end's door: the Trainer's strategy, Fabric's, and the ``initialize`` engine's
    ``save_pretrained`` after two steps at stage 3, with the weights the job holds to compare."""
    import lightning as L

    from zero_strategy import ZeroStrategy, gathered_parameters, initialize

    # the processes exist already, as under torchrun: without LOCAL_RANK the Trainer and Fabric
    # (devices=2) would each start a rank 1 per rank by rerunning this worker's command line, which
    # is pytest's: two copies of the rest of the suite, left running in the background
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")

    def gpt2() -> nn.Module:
        torch.manual_seed(2)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))

    def whole(model: nn.Module) -> dict:
        with gathered_parameters(model):
            return {k: v.detach().clone() for k, v in model.state_dict().items()}

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = gpt2()

        def training_step(self, tokens: torch.Tensor, _: int) -> torch.Tensor:
            return self.model(input_ids=tokens[0], labels=tokens[0]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def on_train_end(self) -> None:  # every rank runs it; bf16: the masters rounded as the weights are
            self.trainer.strategy.save_pretrained(folder / "trainer", dtype="bf16")
            self.held = whole(self.model)

    lit = Lit()
    L.Trainer(strategy=ZeroStrategy(stage=3), accelerator="cpu", devices=2, max_steps=2, precision="bf16-mixed",
              logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(
        lit, train_dataloaders=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(_tokens(0, 0).repeat(4, 1)),
                                                           batch_size=2))
    held = {"trainer": lit.held}

    fabric = L.Fabric(strategy="zero_stage_3", accelerator="cpu", devices=2)
    fabric.launch()
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    for step in range(2):
        fabric.backward(model(input_ids=_tokens(step, rank), labels=_tokens(step, rank)).loss)
        optimizer.step()
        optimizer.zero_grad()
    fabric.strategy.save_pretrained(model, folder / "fabric")
    held["fabric"] = whole(model.module)

    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    engine, _, _, _ = initialize(model=gpt2(), config=config)
    for step in range(2):
        engine.backward(engine(input_ids=_tokens(step, rank), labels=_tokens(step, rank)).loss)
        engine.step()
    engine.save_pretrained(folder / "initialize")
    held["initialize"] = whole(engine.module)
    return held


def _runs(rank: int, world_size: int, folder: str) -> dict:
    folder = Path(folder)
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))
    results = {"plain": _train_and_export(plain, "bf16-mixed", folder / "plain", rank)}
    base = transformers.GPT2LMHeadModel.from_pretrained(folder / "base")  # the "pretrained" model, whole here
    lora = peft.get_peft_model(base, peft.LoraConfig(**LORA))
    results["lora"] = _train_and_export(lora, "32-true", folder / "lora", rank)
    results["front_ends"] = _front_ends(rank, folder / "front_ends")
    return results


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, list[dict]]:
    folder = tmp_path_factory.mktemp("hf_export")
    torch.manual_seed(1)
    base = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))
    with torch.no_grad():  # no init matches it
        for p in base.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    base.save_pretrained(folder / "base")
    return folder, run_distributed(_runs, 2, str(folder))


def _from_pretrained(path: Path, **kwargs) -> tuple[nn.Module, str]:
    """The model and what transformers logged while loading it (missing or unexpected keys, ...)."""
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    root = transformers.utils.logging.get_logger()
    verbosity = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_warning()
    root.addHandler(handler)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
    finally:
        root.removeHandler(handler)
        transformers.utils.logging.set_verbosity(verbosity)
    return model.eval(), log.getvalue()


def _consolidated(ckpt: Path, prefix: str) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(ckpt)
    whole = full_state_dict(reader, reader.trainer_state()["zero_checkpoint"])
    return {k[len(prefix):]: v for k, v in whole.items() if k.startswith(prefix)}


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=PROMPT).logits


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("model*.safetensors")) for k, v in load_file(f).items()}


def test_the_export_loads_with_from_pretrained_and_equals_the_consolidated_weights(exported, tmp_path):
    folder, _ = exported
    ckpt = folder / "plain" / "ckpt"
    assert consolidate([str(ckpt), "--hf", str(tmp_path / "fp32")]) == 0
    assert consolidate([str(ckpt), "--hf", str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    want = _consolidated(ckpt, "model.")  # fp32: the masters of the bf16-mixed run
    reference = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)).eval()
    reference.load_state_dict(want)
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        weights = _weights(tmp_path / name)
        # tied: written once, under the name transformers keeps
        assert sorted(weights) == sorted(k for k in want if k != "lm_head.weight")
        for key, value in weights.items():
            assert value.dtype == dtype and torch.equal(value, want[key].to(dtype)), key
        got, log = _from_pretrained(tmp_path / name)
        assert "missing" not in log.lower() and "unexpected" not in log.lower() and "mismatch" not in log.lower(), log
        assert got.dtype == dtype and got.lm_head.weight is got.transformer.wte.weight
        assert torch.equal(_logits(got), _logits(reference.to(dtype))), name
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["dtype"] == "bfloat16"
    # the job's own exports (strategy.save_pretrained, and transformers' save_pretrained called on every
    # rank) gathered the same fp32 masters
    for live in ("live", "own"):
        assert _weights(folder / "plain" / live).keys() == _weights(tmp_path / "fp32").keys()
        for key, value in _weights(folder / "plain" / live).items():
            assert torch.equal(value, want[key]), (live, key)


def test_the_loading_check_sees_a_missing_key(exported, tmp_path):
    """The capture above is not blind: an export without one tensor makes transformers say so."""
    folder, _ = exported
    broken = tmp_path / "broken"
    shutil.copytree(folder / "plain" / "live", broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["transformer.h.1.mlp.c_fc.weight"]
    from safetensors.torch import save_file
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    _, log = _from_pretrained(broken)
    assert "transformer.h.1.mlp.c_fc.weight" in log and "missing" in log.lower(), log


def test_max_shard_size_splits_into_files_with_a_correct_index(exported, tmp_path):
    folder, _ = exported
    out = tmp_path / "sharded"
    (out).mkdir()
    (out / "tokenizer.json").write_text("{}")  # another file of the directory survives the swap
    assert consolidate([str(folder / "plain" / "ckpt"), "--hf", str(out), "--max-shard-size", "30KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(files) > 2 and files == sorted(set(index["weight_map"].values()))
    assert all(name.endswith(f"-of-{len(files):05d}.safetensors") for name in files)
    total = 0
    for name in files:
        with safe_open(out / name, "pt") as f:
            keys = set(f.keys())
            assert keys == {k for k, v in index["weight_map"].items() if v == name}
            total += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in keys)
        assert (out / name).stat().st_size <= 30_000 + 4096  # a tensor alone may exceed it; here none does
    assert index["metadata"]["total_size"] == total
    assert (out / "tokenizer.json").read_text() == "{}"
    got, log = _from_pretrained(out)
    assert "missing" not in log.lower() and "unexpected" not in log.lower(), log
    assert torch.equal(_logits(got), _logits(_from_pretrained(folder / "plain" / "live")[0]))
    # exported again into one file: the old shards and index go, the tokenizer stays
    assert consolidate([str(folder / "plain" / "ckpt"), "--hf", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer.json"]


def test_a_peft_model_exports_merged_and_its_adapter_loads_with_peft(exported, tmp_path):
    folder, results = exported
    out = tmp_path / "lora"
    assert consolidate([str(folder / "lora" / "ckpt"), "--hf", str(out)]) == 0
    live_logits = results[0]["lora"]["logits"]
    base, _ = _from_pretrained(folder / "base")
    adapted = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
    assert torch.equal(_logits(adapted), live_logits)  # the adapter alone, on the unchanged base: the job's model
    merged, log = _from_pretrained(out)
    assert "missing" not in log.lower() and "unexpected" not in log.lower(), log
    reference = adapted.merge_and_unload().state_dict()  # peft's own merge of the same weights
    for key, value in merged.state_dict().items():
        assert torch.equal(value, reference[key]), key
    # merging changes the order of the float operations, not the model
    torch.testing.assert_close(_logits(merged), live_logits, rtol=1e-5, atol=1e-5)
    for key, value in load_file(folder / "lora" / "live" / "adapter" / "adapter_model.safetensors").items():
        assert torch.equal(value, load_file(out / "adapter" / "adapter_model.safetensors")[key]), key
    # peft's own save_pretrained on the stage-3 model, called on every rank, wrote the adapter alone
    own = peft.PeftModel.from_pretrained(_from_pretrained(folder / "base")[0], folder / "lora" / "own").eval()
    assert torch.equal(_logits(own), live_logits)


def test_save_pretrained_on_a_stage3_model_never_writes_empty_tensors(exported):
    folder, results = exported
    for rank, result in enumerate(results):
        for run in ("plain", "lora"):
            assert "is_main_process=(rank == 0)" in result[run]["refused"] and not result[run]["refused_wrote"]
    for path in (folder / "plain" / "own").glob("*.safetensors"):
        assert all(v.numel() > 0 for v in load_file(path).values())


def test_every_front_end_exports_the_weights_the_job_holds(exported):
    folder, results = exported
    for name, held in results[0]["front_ends"].items():
        got, log = _from_pretrained(folder / "front_ends" / name)
        assert "missing" not in log.lower() and "unexpected" not in log.lower(), (name, log)
        for key, value in got.state_dict().items():
            assert torch.equal(value, held[key]), (name, key)


def test_sizes_and_shard_plans():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size(1234) == 1234
    for bad in ("5 parsecs", "-1GB", 0, "GB"):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)
    assert plan_shards([("a", 4), ("b", 4), ("c", 9), ("d", 1)], 8) == [["a", "b"], ["c"], ["d"]]
    assert plan_shards([], 8) == [[]]


def test_bad_targets_are_refused_before_anything_is_written(exported, tmp_path, capsys):
    folder, _ = exported
    ckpt = str(folder / "plain" / "ckpt")
    (tmp_path / "busy" / "runs").mkdir(parents=True)
    assert consolidate([ckpt, "--hf", str(tmp_path / "busy")]) == 2
    assert "holds directories ['runs']" in capsys.readouterr().err
    assert consolidate([ckpt, "--hf", str(tmp_path / "x"), "--max-shard-size", "lots"]) == 2
    assert "max_shard_size='lots'" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert consolidate([ckpt, "--hf", str(tmp_path / "y"), "--prefix", "nothing."]) == 2
    assert "prefix 'nothing.'" in capsys.readouterr().err and not (tmp_path / "y").exists()
    damaged = tmp_path / "damaged"
    shutil.copytree(ckpt, damaged)
    data = bytearray((damaged / "rank_00001.safetensors").read_bytes())
    header_bytes = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + header_bytes])
    key = next(k for k in header if k.startswith("master/model.transformer.wte.weight@"))  # what the export reads
    data[8 + header_bytes + header[key]["data_offsets"][0]] ^= 0xFF
    (damaged / "rank_00001.safetensors").write_bytes(bytes(data))
    shutil.copytree(folder / "plain" / "live", tmp_path / "earlier")
    assert consolidate([str(damaged), "--hf", str(tmp_path / "earlier")]) == 2
    assert "rank_00001.safetensors is damaged" in capsys.readouterr().err
    assert _weights(tmp_path / "earlier").keys() == _weights(folder / "plain" / "live").keys()  # left as it was
    assert not list(tmp_path.glob(".earlier*"))
