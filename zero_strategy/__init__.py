"""ZeRO sharded training for PyTorch Lightning.

Importing the package registers ``"zero_stage_1"``, ``"zero_stage_2"``, ``"zero_stage_3"``,
``"zero_stage_2_offload"`` and ``"zero_stage_3_offload"`` with Lightning's StrategyRegistry, so
``Trainer(strategy="zero_stage_2")`` works, without importing Lightning itself: see
[Note: a lazy package face] and [Note: registering with Lightning lazily].

[Note: a lazy package face]
The public names below are imported from their modules on first use (PEP 562's module
``__getattr__``), and so are the subpackages (``zero_strategy.engine``, ``.kernels``, ...). So
``import zero_strategy`` costs milliseconds, and the Lightning-free parts (``ZeroConfig``,
``ZeroOptimizer``, ``estimate_memory``, the engine and the kernels) import without Lightning, Hydra
or rich; ``ZeroStrategy`` and ``ZeroPrecision`` import Lightning when first named.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ below imports these
    from .activation import (SavedActivationMeter, apply_activation_checkpointing, offload_activations,
                             saved_activation_bytes)
    from .checkpoint import consolidate_checkpoint
    from .config import ZeroConfig
    from .deepspeed.engine import initialize
    from .deepspeed.launch import init_distributed
    from .engine import ZeroOptimizer
    from .engine.parameters import gathered_parameters
    from .memory import count_parameters, estimate_memory, memory_stats
    from .precision import ZeroPrecision
    from .strategy import ZeroStrategy

_PUBLIC_NAMES = {  # name -> the module (below this package) that defines it
    "SavedActivationMeter": "activation", "apply_activation_checkpointing": "activation",
    "offload_activations": "activation", "saved_activation_bytes": "activation",
    "consolidate_checkpoint": "checkpoint",
    "ZeroConfig": "config",
    "initialize": "deepspeed.engine", "init_distributed": "deepspeed.launch",  # DeepSpeed's loop API
    "ZeroOptimizer": "engine", "gathered_parameters": "engine.parameters",
    "count_parameters": "memory", "estimate_memory": "memory", "memory_stats": "memory",
    "ZeroPrecision": "precision",
    "ZeroStrategy": "strategy",
}
_SUBMODULES = ("activation", "checkpoint", "cli", "config", "data", "deepspeed", "deepspeed_config", "engine",
               "kernels", "memory", "models", "precision", "strategy")

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
# Lightning's StrategyRegistry lives in ``lightning.pytorch.strategies`` and only scans Lightning's
# own classes, so a third-party strategy registers itself when its package is imported. Importing
# Lightning here would cost seconds and tie the engine to it, so:
# - if ``lightning.pytorch.strategies`` is already imported, the names are registered now;
# - otherwise a post-import hook (a finder at the front of ``sys.meta_path``, as ``wrapt.when_imported``
#   does it) waits for that module: when Python has executed it, the names are registered, before
#   any Trainer can exist. The hook stays installed, so a re-import of Lightning's module (a test
#   that purges sys.modules, importlib.reload) registers again; it costs one string comparison per
#   import.
# The registry holds ``_zero_strategy`` for each name, a function that imports ZeroStrategy when a
# Trainer asks for the name: registering the class itself would import this package's Lightning
# code in the middle of Lightning's own import (circular), or import Lightning now. Lightning only
# ever calls the entry (``StrategyRegistry.get(name)``), so a function serves as well as the class.
# Chosen over the alternatives: entry points (Lightning reads none for strategies), registering in
# ZeroStrategy's module (only runs once someone names ZeroStrategy, so ``Trainer(strategy=
# "zero_stage_3")`` after a bare ``import zero_strategy`` would fail), and importing Lightning when
# it is installed (the seconds this note is about).

STRATEGY_NAMES: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (description, ZeroStrategy arguments)
    "zero_stage_1": ("ZeRO stage 1 (ZeroStrategy)", {"stage": 1}),
    "zero_stage_2": ("ZeRO stage 2 (ZeroStrategy)", {"stage": 2}),
    "zero_stage_3": ("ZeRO stage 3 (ZeroStrategy)", {"stage": 3}),
    "zero_stage_2_offload": ("ZeRO stage 2, optimizer state and master weights in host memory (ZeroStrategy)",
                             {"stage": 2, "offload_optimizer": True}),
    "zero_stage_3_offload": ("ZeRO stage 3, optimizer state, master weights and parameter shards in host memory "
                             "(ZeroStrategy)", {"stage": 3, "offload_optimizer": True, "offload_params": True}),
}
"""The names ``Trainer(strategy=...)`` accepts for ZeroStrategy, with what each one sets."""

_LIGHTNING_STRATEGIES = "lightning.pytorch.strategies"  # the module that defines StrategyRegistry


def _zero_strategy(**kwargs: Any) -> Any:
    """A ZeroStrategy built from a registered name's arguments: see [Note: registering with Lightning lazily]."""
    from .strategy import ZeroStrategy

    return ZeroStrategy(**kwargs)


def register_strategy_names(registry: Any, strategy: Callable[..., Any] = _zero_strategy) -> None:
    """Register ``STRATEGY_NAMES`` with a Lightning StrategyRegistry, each built by ``strategy``
    (a function or class taking ZeroStrategy's arguments). Names already there are left as they
    are, so calling it again is harmless."""
    for name, (description, kwargs) in STRATEGY_NAMES.items():
        if name not in registry:
            registry.register(name, strategy, description=description, **kwargs)


def _register_with_loaded_lightning() -> None:
    registry = getattr(sys.modules.get(_LIGHTNING_STRATEGIES), "StrategyRegistry", None)
    if registry is not None:
        register_strategy_names(registry)


class _RunAfterImport:
    """A ``sys.meta_path`` finder that runs ``callback`` each time module ``name`` has been executed.

    It finds nothing itself: it asks the finders behind it for ``name``'s spec and wraps that
    spec's loader (see ``_LoaderThenCallback``); every other import passes straight through.
    """

    zero_strategy_hook = True  # how a reloaded zero_strategy recognises an installed hook

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name = name
        self.callback = callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
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
                              "no exec_module), so Trainer(strategy='zero_stage_2') and the other names may be "
                              "unknown: call zero_strategy.register_strategy_names(StrategyRegistry) after importing "
                              "Lightning, or pass ZeroStrategy(...) itself.", stacklevel=2)
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
    sys.meta_path.insert(0, _RunAfterImport(_LIGHTNING_STRATEGIES, _register_with_loaded_lightning))
