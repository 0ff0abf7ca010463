"""ZeRO sharded training for PyTorch Lightning.

Importing the package registers ``"zero_stage_1"``, ``"zero_stage_2"``, ``"zero_stage_3"``,
``"zero_stage_2_offload"`` and ``"zero_stage_3_offload"`` with Lightning's StrategyRegistry and
Fabric's, so ``Trainer(strategy="zero_stage_2")`` and ``Fabric(strategy="zero_stage_2")`` work,
without importing Lightning itself: see
[Note: a lazy package face] and [Note: registering with Lightning lazily].

[Note: a lazy package face]
The public names below are imported from their modules on first use (PEP 562's module
``__getattr__``), and so are the subpackages (``zero_strategy.engine``, ``.kernels``, ...). So
``import zero_strategy`` costs milliseconds, and the Lightning-free parts (``ZeroConfig``,
``ZeroOptimizer``, ``estimate_memory``, the engine and the kernels) import without Lightning, Hydra
or rich; ``ZeroStrategy``, ``ZeroPrecision`` and the Fabric names import Lightning when first named.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import TYPE_CHECKING, Any, Callable, Optional

from .names import STRATEGY_NAMES, register_names

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ below imports these
    from .activation import (SavedActivationMeter, apply_activation_checkpointing, offload_activations,
                             saved_activation_bytes)
    from .checkpoint import consolidate_checkpoint, export_hf_checkpoint
    from .config import ZeroConfig
    from .deepspeed.accelerator import get_accelerator
    from .deepspeed.arguments import add_config_arguments
    from .deepspeed.engine import initialize
    from .deepspeed.launch import init_distributed
    from .deepspeed.unsupported import init_inference
    from .engine import ZeroOptimizer
    from .engine.diagnose.watchdog import CollectiveError, UnitOrderError
    from .engine.join import Join
    from .engine.params.flat_parameters import gathered_parameters
    from .fabric import ZeroFabricPrecision, ZeroFabricStrategy
    from .generation import any_rank_busy
    from .memory import count_parameters, estimate_memory, memory_stats
    from .optimizers import DeepSpeedMuon, MuonWithAdamW
    from .precision import ZeroPrecision
    from .strategy import ZeroStrategy

_PUBLIC_NAMES = {  # name -> the module (below this package) that defines it
    "SavedActivationMeter": "activation", "apply_activation_checkpointing": "activation",
    "offload_activations": "activation", "saved_activation_bytes": "activation",
    "consolidate_checkpoint": "checkpoint", "export_hf_checkpoint": "checkpoint",
    "ZeroConfig": "config",
    "initialize": "deepspeed.engine", "init_distributed": "deepspeed.launch",  # DeepSpeed's loop API
    "add_config_arguments": "deepspeed.arguments", "get_accelerator": "deepspeed.accelerator",  # DeepSpeed's scripts
    "init_inference": "deepspeed.unsupported",  # raises, naming what to do instead
    "ZeroOptimizer": "engine", "gathered_parameters": "engine.params.flat_parameters",
    "MuonWithAdamW": "optimizers",  # Muon and AdamW as one optimizer (automatic optimization)
    "DeepSpeedMuon": "optimizers",  # what a DeepSpeed config's "type": "Muon" builds
    "count_parameters": "memory", "estimate_memory": "memory", "memory_stats": "memory",
    "ZeroPrecision": "precision",
    "load_pretrained": "pretrained", "sharded_init": "pretrained",
    "ZeroStrategy": "strategy",
    "ZeroFabricPrecision": "fabric", "ZeroFabricStrategy": "fabric",
    "any_rank_busy": "generation", "Join": "engine.join",  # ranks whose work differs: see docs/ranks.md
    "UnitOrderError": "engine.diagnose.watchdog", "CollectiveError": "engine.diagnose.watchdog",  # ranks out of step,
                                                                                                  # hung collectives
}
_SUBMODULES = ("activation", "checkpoint", "cli", "config", "data", "deepspeed", "engine",
               "fabric", "frontend", "generation", "kernels", "memory", "models", "optimizers", "precision",
               "pretrained", "strategy")
# what `import zero_strategy as deepspeed` scripts reach as deepspeed.<name> (see zero_strategy/deepspeed/)
_SUBMODULES += ("accelerator", "checkpointing", "comm", "moe", "ops", "pipe", "utils", "zero")

__all__ = sorted(_PUBLIC_NAMES)


def __getattr__(name: str) -> Any:
    """Import a public name or a subpackage on first use: see [Note: a lazy package face]."""
    if name in _PUBLIC_NAMES:
        value = getattr(importlib.import_module(f"{__name__}.{_PUBLIC_NAMES[name]}"), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}; its public names are {__all__}.")
    globals()[name] = value  # later lookups find it without calling this
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC_NAMES, *_SUBMODULES})


# ---- registration with Lightning's StrategyRegistry ------------------------------------------

# [Note: registering with Lightning lazily]
# Lightning's registries (the Trainer's ``StrategyRegistry`` in ``lightning.pytorch.strategies``,
# Fabric's ``STRATEGY_REGISTRY`` in ``lightning.fabric.strategies``) only scan Lightning's own
# classes, so a third-party strategy registers itself when its package is imported. Importing
# Lightning here would cost seconds and tie the engine to it, so, for each of the two modules:
# - if it is already imported, the names are registered now;
# - otherwise a post-import hook (a finder at the front of ``sys.meta_path``, as ``wrapt.when_imported``
#   does it) waits for it: when Python has executed it, the names are registered, before any Trainer
#   or Fabric can exist. The hook stays installed, so a re-import of Lightning's module (a test that
#   purges sys.modules, importlib.reload) registers again; it costs one string comparison per import.
# The registries hold ``_zero_strategy`` (``_zero_fabric_strategy``) for each name, a function that
# imports ZeroStrategy (ZeroFabricStrategy) when a Trainer (Fabric) asks for the name: registering
# the class itself would import this package's Lightning code in the middle of Lightning's own import
# (circular), or import Lightning now. Lightning only ever calls the entry (``registry.get(name)``),
# so a function serves as well as the class.
# Chosen over the alternatives: entry points (Lightning reads none for strategies), registering in
# ZeroStrategy's module (only runs once someone names ZeroStrategy, so ``Trainer(strategy=
# "zero_stage_3")`` after a bare ``import zero_strategy`` would fail), and importing Lightning when
# it is installed (the seconds this note is about).



def _zero_strategy(**kwargs: Any) -> Any:
    """A ZeroStrategy built from a registered name's arguments: see [Note: registering with Lightning lazily]."""
    from .strategy import ZeroStrategy

    return ZeroStrategy(**kwargs)


def _zero_fabric_strategy(**kwargs: Any) -> Any:
    """A ZeroFabricStrategy built from a registered name's arguments (see [Note: registering with Lightning lazily])."""
    from .fabric import ZeroFabricStrategy

    return ZeroFabricStrategy(**kwargs)


_REGISTRIES: dict[str, tuple[str, Callable[..., Any]]] = {
    # the module that defines a registry: (the registry's name in it, what builds our strategy)
    "lightning.pytorch.strategies": ("StrategyRegistry", _zero_strategy),
    "lightning.fabric.strategies": ("STRATEGY_REGISTRY", _zero_fabric_strategy),
}
_LABELS = {_zero_strategy: "ZeroStrategy", _zero_fabric_strategy: "ZeroFabricStrategy"}


def register_strategy_names(registry: Any, strategy: Optional[Callable[..., Any]] = None) -> None:
    """Register ``STRATEGY_NAMES`` with a Lightning strategy registry, each built by ``strategy`` (a
    function or class taking ZeroStrategy's arguments; by default ZeroStrategy for the Trainer's
    registry and ZeroFabricStrategy for Fabric's). Names already there are left as they are, so
    calling it again is harmless."""
    if strategy is None:
        strategy = next((build for module, (attribute, build) in _REGISTRIES.items()
                         if getattr(sys.modules.get(module), attribute, None) is registry), _zero_strategy)
    register_names(registry, strategy, _LABELS.get(strategy, getattr(strategy, "__name__", "ZeRO")))


def _register_with_loaded_lightning() -> None:
    for module, (attribute, strategy) in _REGISTRIES.items():
        registry = getattr(sys.modules.get(module), attribute, None)
        if registry is not None:
            register_strategy_names(registry, strategy)


class _RunAfterImport:
    """A ``sys.meta_path`` finder that runs ``callback`` each time one of the modules ``names`` has
    been executed.

    It finds nothing itself: it asks the finders behind it for ``name``'s spec and wraps that
    spec's loader (see ``_LoaderThenCallback``); every other import passes straight through.
    """

    zero_strategy_hook = True  # how a reloaded zero_strategy recognises an installed hook

    def __init__(self, names: tuple[str, ...], callback: Callable[[], None]) -> None:
        self.names = names
        self.callback = callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.names:
            return None
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is None:
                continue
            if hasattr(spec.loader, "exec_module"):
                spec.loader = _LoaderThenCallback(spec.loader, self.callback)
            else:  # a legacy loader runs the module in a way that cannot be followed
                warnings.warn(f"zero_strategy cannot follow the import of {fullname} (its loader {spec.loader!r} has "
                              "no exec_module), so Trainer(strategy='zero_stage_2') (or Fabric's) and the other "
                              "names may be unknown: call zero_strategy.register_strategy_names(registry) after "
                              "importing Lightning, or pass ZeroStrategy(...) (ZeroFabricStrategy(...)) itself.",
                              stacklevel=2)
            return spec
        return None


class _LoaderThenCallback:
    """Runs the real loader, then the callback. The module gets the real loader back as its
    ``__loader__`` (source lookups, resources and reloads go to it), so nothing else can tell."""

    def __init__(self, loader: Any, callback: Callable[[], None]) -> None:
        self.loader = loader
        self.callback = callback

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = self.loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.callback()


_register_with_loaded_lightning()
if not any(getattr(finder, "zero_strategy_hook", False) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RunAfterImport(tuple(_REGISTRIES), _register_with_loaded_lightning))
