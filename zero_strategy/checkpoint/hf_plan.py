"""What a Hugging Face export writes, decided from the live module: key names, merges, configs.

An ``ExportPlan`` lists every tensor of the export as an ``Entry``: its name in the export and the
module's state-dict key that holds its values, plus, for a LoRA layer, the adapters to merge into
it. The plan is made from the live module (so transformers' and peft's own objects decide the
names) and is plain data, so a sharded checkpoint records it at save time (``hf_record``) and
``zero-consolidate --hf`` executes it later without the model, transformers or peft.

[Note: which submodule is exported]
The exported model is the outermost submodule that is a transformers ``PreTrainedModel`` (it has a
``config`` with ``to_json_string`` and a ``save_pretrained``) or a peft ``PeftModel``: a
LightningModule's ``self.model = GPT2LMHeadModel(...)`` is found at ``model.``, a bare model given to
Fabric or ``initialize`` at the root. Its path is the prefix stripped from the module's keys. Two
such submodules side by side are ambiguous: the caller names one (``prefix=``, ``--prefix``). A
module with none is exported with every key, under a prefix the caller gives (or none).

[Note: tied weights in an export]
safetensors stores no aliases, and transformers' ``save_pretrained`` writes a tied parameter once,
under the name that is not one of the model's ``_tied_weights_keys`` (GPT-2: ``transformer.wte.weight``,
not ``lm_head.weight``); ``from_pretrained`` ties the other back without a warning. The plan does the
same: entries whose sources are one Parameter keep one name, the first that is not a tied key.

[Note: merging LoRA in an export]
For a peft model the full export is the base model with the active adapters merged, as peft's
``merge_and_unload`` leaves it: a LoRA ``Linear``'s ``base_layer.weight`` becomes ``weight`` plus
``transpose(B @ A, fan_in_fan_out) * scaling`` for each active adapter (the layer's own scaling and
fan_in_fan_out, which peft sets for GPT-2's Conv1D), the adapters' own tensors are left out, and a
``modules_to_save`` wrapper is written as its trained copy. Layers peft merges in other ways (DoRA,
LoRA on embeddings or convolutions, other tuners) are refused with their names. The adapter alone
(``adapter_model.safetensors``, ``adapter_config.json``) is chosen by peft's own
``get_peft_model_state_dict``, run on placeholders, so its keys are exactly what peft writes.
"""

from __future__ import annotations

import copy
import json
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch import nn


@dataclass(frozen=True)
class Entry:
    """One tensor of the export: ``out`` its name there, ``source`` the module's state-dict key of its
    values, ``merges`` the LoRA adapters added to it: ``(lora_A key, lora_B key, scaling, fan_in_fan_out)``."""

    out: str
    source: str
    merges: tuple[tuple[str, str, float, bool], ...] = ()


@dataclass
class ExportPlan:
    """Every tensor of an export, in writing order, and the texts of its configuration files."""

    prefix: str
    entries: list[Entry]
    config: Optional[str] = None  # config.json (JSON text), architectures set
    generation_config: Optional[str] = None
    adapter_entries: list[Entry] = field(default_factory=list)  # the peft adapter alone, if any
    adapter_config: Optional[str] = None

    def to_record(self) -> dict[str, Any]:
        """Plain data (strings, numbers, lists) for a checkpoint's trainer state, loadable with weights_only."""
        return {"prefix": self.prefix,
                "entries": [[e.out, e.source, [list(m) for m in e.merges]] for e in self.entries],
                "config": self.config, "generation_config": self.generation_config,
                "adapter_entries": [[e.out, e.source] for e in self.adapter_entries],
                "adapter_config": self.adapter_config}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "ExportPlan":
        return cls(prefix=record["prefix"],
                   entries=[Entry(o, s, tuple((a, b, float(k), bool(f)) for a, b, k, f in m))
                            for o, s, m in record["entries"]],
                   config=record.get("config"), generation_config=record.get("generation_config"),
                   adapter_entries=[Entry(o, s) for o, s in record.get("adapter_entries", [])],
                   adapter_config=record.get("adapter_config"))


def is_peft_model(module: nn.Module) -> bool:
    return isinstance(getattr(module, "peft_config", None), dict) and callable(getattr(module, "get_base_model", None))


def is_pretrained_model(module: nn.Module) -> bool:
    return callable(getattr(module, "save_pretrained", None)) and callable(
        getattr(getattr(module, "config", None), "to_json_string", None))


def exported_models(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The outermost peft or transformers models inside ``module`` (itself included), with their paths."""
    found: list[str] = []
    for name, sub in module.named_modules():
        if any(f == "" or name.startswith(f + ".") for f in found):  # inside one found already
            continue
        if is_peft_model(sub) or is_pretrained_model(sub):
            found.append(name)
            yield name, sub


def find_exported(module: nn.Module, prefix: Optional[str] = None) -> tuple[str, Optional[nn.Module]]:
    """The exported submodule and its key prefix (see [Note: which submodule is exported])."""
    if prefix is not None:
        path = prefix.rstrip(".")
        try:
            sub = module.get_submodule(path) if path else module
        except AttributeError as err:
            raise ValueError(f"prefix={prefix!r} names no submodule of {type(module).__name__} ({err}); give the "
                             "attribute path of the model to export, such as 'model.' (or '' for the whole module).")
        return (path + "." if path else ""), sub
    models = list(exported_models(module))
    if len(models) > 1:
        raise ValueError(f"{type(module).__name__} holds {len(models)} Hugging Face models ({[n for n, _ in models]}); "
                         "pass prefix='<attribute path>.' to say which one to export.")
    if not models:
        return "", None
    name, sub = models[0]
    return (name + "." if name else ""), sub


def _tied_patterns(model: nn.Module) -> list[str]:
    """The model's ``_tied_weights_keys`` (a dict or a list, per submodule), as patterns over its keys."""
    out = []
    for name, sub in model.named_modules():
        keys = getattr(sub, "_tied_weights_keys", None) or ()
        out += [f"{name}.{k}" if name else k for k in (keys.keys() if isinstance(keys, dict) else keys)]
    return out


def _without_aliases(entries: list[Entry], tensors: dict[str, Any], patterns: list[str]) -> list[Entry]:
    """One entry per tensor (see [Note: tied weights in an export])."""
    by_tensor: dict[int, list[Entry]] = {}
    for e in entries:
        by_tensor.setdefault(id(tensors[e.source]), []).append(e)
    keep = set()
    for group in by_tensor.values():
        untied = [e for e in group if not any(re.search(p, e.out) for p in patterns)]
        keep.add((untied or group)[0].out)
    return [e for e in entries if e.out in keep]


def _config_text(model: nn.Module) -> str:
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    return config.to_json_string()


def _generation_config_text(model: nn.Module) -> Optional[str]:
    can_generate = getattr(model, "can_generate", None)
    generation = getattr(model, "generation_config", None)
    if callable(can_generate) and can_generate() and generation is not None:
        return generation.to_json_string()
    return None


def plain_plan(keys: list[str], prefix: str, tensors: Optional[dict[str, Any]] = None) -> ExportPlan:
    """Every key under ``prefix``, with the prefix stripped; aliases (same object in ``tensors``) once."""
    entries = [Entry(k[len(prefix):], k) for k in keys if k.startswith(prefix)]
    if not entries:
        raise ValueError(f"no key of the module starts with the prefix {prefix!r} (keys: {keys[:3]}...); give the "
                         "attribute path of the model to export, or '' for every key.")
    return ExportPlan(prefix, _without_aliases(entries, tensors, []) if tensors is not None else entries)


def make_plan(module: nn.Module, prefix: Optional[str] = None, merge: bool = True) -> ExportPlan:
    """The export of ``module`` (see the notes above); raises, naming the layer, for what cannot be merged
    (``merge=False``: the adapter alone, whatever its layers)."""
    prefix, sub = find_exported(module, prefix)
    tensors = {k: v for k, v in module.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}
    if sub is None or not (is_peft_model(sub) or is_pretrained_model(sub) or _lora_layers(sub)):
        return plain_plan(list(tensors), prefix, tensors)
    base = sub.get_base_model() if is_peft_model(sub) else sub
    base_path = next(n for n, m in sub.named_modules() if m is base)
    base_prefix = prefix + (base_path + "." if base_path else "")
    entries = _merged_entries(base, base_prefix, tensors) if merge else []
    plan = ExportPlan(prefix, _without_aliases(entries, tensors, _tied_patterns(base)))
    if is_pretrained_model(base):
        plan.config, plan.generation_config = _config_text(base), _generation_config_text(base)
    if is_peft_model(sub):
        plan.adapter_entries, plan.adapter_config = _adapter(sub, prefix, base)
    return plan


def _lora_layers(base: nn.Module) -> dict[str, nn.Module]:
    """peft's tuner layers inside ``base`` (by path); empty without peft or without adapters."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return {}
    return {n: m for n, m in base.named_modules() if isinstance(m, BaseTunerLayer)}


def _merged_entries(base: nn.Module, base_prefix: str, tensors: dict[str, Any]) -> list[Entry]:
    """The base model's keys with the active adapters merged (see [Note: merging LoRA in an export])."""
    tuners = _lora_layers(base)
    wrappers = {n: m for n, m in base.named_modules()
                if hasattr(m, "original_module") and hasattr(m, "modules_to_save")}  # peft's modules_to_save
    merges = {path: _lora_merges(path, layer, base_prefix) for path, layer in tuners.items()}
    entries = []
    for key in tensors:
        if not key.startswith(base_prefix):
            continue
        rel = key[len(base_prefix):]
        owner = max((p for p in [*tuners, *wrappers] if rel.startswith(p + ".")), key=len, default=None)
        if owner is None:
            entries.append(Entry(rel, key))
            continue
        rest = rel[len(owner) + 1:]
        if owner in wrappers:
            active = _single_active(wrappers[owner], owner)
            if rest.startswith(f"modules_to_save.{active}."):
                entries.append(Entry(f"{owner}.{rest[len(f'modules_to_save.{active}.'):]}", key))
            continue  # the original module, and other adapters' copies
        if rest.startswith("base_layer."):
            name = f"{owner}.{rest[len('base_layer.'):]}"
            entries.append(Entry(name, key, merges[owner] if rest == "base_layer.weight" else ()))
    return entries


def _single_active(module: nn.Module, path: str) -> str:
    active = getattr(module, "active_adapters", None)
    active = [module.active_adapter] if active is None else list(active() if callable(active) else active)
    if len(active) != 1:
        raise ValueError(f"{path} has {len(active)} active adapters ({active}); activate one (set_adapter) to export.")
    return active[0] if isinstance(active[0], str) else active[0][0]


def _lora_merges(path: str, layer: nn.Module, base_prefix: str) -> tuple[tuple[str, str, float, bool], ...]:
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:  # pragma: no cover - _lora_layers found peft
        LoraLinear = ()
    active = list(layer.active_adapters) if not layer.disable_adapters else []
    unsupported = ""
    if type(layer) is not LoraLinear:
        unsupported = f"a {type(layer).__module__}.{type(layer).__name__}"
    elif any(layer.use_dora.get(a) for a in active):
        unsupported = "DoRA"
    elif any(getattr(layer, "lora_bias", {}).get(a) for a in active):
        unsupported = "LoRA with lora_bias"
    if unsupported:
        raise ValueError(f"the layer {path} is {unsupported}, which the Hugging Face export cannot merge (it merges "
                         "LoRA Linear layers, GPT-2's Conv1D included); merge it with peft's merge_and_unload() on a "
                         "gathered model, or export the adapter alone.")
    return tuple((f"{base_prefix}{path}.lora_A.{a}.weight", f"{base_prefix}{path}.lora_B.{a}.weight",
                  float(layer.scaling[a]), bool(layer.fan_in_fan_out)) for a in active if a in layer.lora_A)


def _adapter(peft_model: nn.Module, prefix: str, base: nn.Module) -> tuple[list[Entry], str]:
    """peft's own choice and names of the active adapter's tensors, and its adapter_config.json."""
    from peft import get_peft_model_state_dict

    active = peft_model.active_adapters if hasattr(peft_model, "active_adapters") else [peft_model.active_adapter]
    if len(active) != 1:
        raise ValueError(f"the peft model has {len(active)} active adapters ({active}); activate one "
                         "(set_adapter) to export it.")
    name = active[0]
    keys = [k for k in peft_model.state_dict(keep_vars=True)]
    placeholders = {k: torch.empty(0) for k in keys}  # peft selects and renames; the values are never read
    source_of = {id(v): k for k, v in placeholders.items()}
    chosen = get_peft_model_state_dict(peft_model, state_dict=placeholders, adapter_name=name)
    entries = [Entry(out, prefix + source_of[id(v)]) for out, v in chosen.items()]
    config = peft_model.peft_config[name]
    record = {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}
    record["inference_mode"] = True  # as peft's save_pretrained writes it
    if record.get("base_model_name_or_path") is None:
        record["base_model_name_or_path"] = base.__dict__.get("name_or_path") or None
    if record.get("task_type") is None:
        record["auto_mapping"] = {"base_model_class": type(base).__name__, "parent_library": type(base).__module__}
    return entries, json.dumps(record, indent=2, sort_keys=True)


def hf_record(module: nn.Module) -> Optional[dict[str, Any]]:
    """The export plan of ``module`` for a checkpoint, or None when it holds no Hugging Face model; a
    plan that cannot be made is recorded as its error, which the export reports (a save never fails
    for it)."""
    try:
        if not list(exported_models(module)):
            return None
        return make_plan(module).to_record()
    except Exception as err:  # noqa: BLE001 - recorded, and reported by zero-consolidate --hf
        warnings.warn(f"the checkpoint records no Hugging Face export plan ({type(err).__name__}: {err}); "
                      "zero-consolidate --hf will need --prefix to export its keys as they are.", stacklevel=2)
        return {"error": f"{type(err).__name__}: {err}"}
