"""The strategy names this package registers with Lightning's registries, and the registering.

Kept apart from the package's ``__init__`` (which picks the default builders, and so imports the
strategies lazily) so that the strategies' own ``register_strategies`` can register without
importing the package back: no import circle (tests/test_layers.py).
"""

from __future__ import annotations

from typing import Any, Callable

STRATEGY_NAMES: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (description, ZeroStrategy and ZeroFabricStrategy arguments)
    "zero_stage_1": ("ZeRO stage 1", {"stage": 1}),
    "zero_stage_2": ("ZeRO stage 2", {"stage": 2}),
    "zero_stage_3": ("ZeRO stage 3", {"stage": 3}),
    "zero_stage_2_offload": ("ZeRO stage 2, optimizer state and master weights in host memory",
                             {"stage": 2, "offload_optimizer": True}),
    "zero_stage_3_offload": ("ZeRO stage 3, optimizer state, master weights and parameter shards in host memory",
                             {"stage": 3, "offload_optimizer": True, "offload_params": True}),
}
"""The names ``Trainer(strategy=...)`` and ``Fabric(strategy=...)`` accept, with what each one sets."""


def register_names(registry: Any, strategy: Callable[..., Any], label: str) -> None:
    """Register ``STRATEGY_NAMES`` in ``registry``, each built by ``strategy``; names already there are
    left as they are, so calling it again is harmless."""
    for name, (description, kwargs) in STRATEGY_NAMES.items():
        if name not in registry:
            registry.register(name, strategy, description=f"{description} ({label})", **kwargs)
