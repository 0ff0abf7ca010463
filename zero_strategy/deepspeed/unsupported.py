"""DeepSpeed names for what this package does not do (mixture-of-experts parallelism, pipeline
parallelism): importable, so a script that imports them for an option it does not use runs, and an
error naming the alternative when one is used (not an AttributeError in the middle of a script)."""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["INFERENCE", "MOE", "PIPE", "UnsupportedFeature", "init_inference", "refusing"]

MOE = ("mixture-of-experts parallelism (deepspeed.moe) is not supported: this package is data parallel (ZeRO) "
       "only. Build the experts as ordinary modules (they then train as data-parallel parameters, every rank holding "
       "its shard of each), or run this script with DeepSpeed.")
PIPE = ("pipeline parallelism (deepspeed.pipe) is not supported: this package is data parallel (ZeRO) only. Use "
        "ZeRO stage 3 to fit the model (its parameters are sharded over the ranks, with offload for more), or run "
        "this script with DeepSpeed.")


class UnsupportedFeature(NotImplementedError):
    """A DeepSpeed feature this package does not offer; the message says what to use instead."""


def refusing(name: str, why: str) -> Callable[..., Any]:
    """A stand-in for DeepSpeed's ``name`` (a class or function) that raises ``why`` when used."""

    class Refused:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise UnsupportedFeature(f"{name}: {why}")

        def __init_subclass__(cls, **kwargs: Any) -> None:
            raise UnsupportedFeature(f"{name} (subclassed by {cls.__name__}): {why}")

    Refused.__name__ = Refused.__qualname__ = name.rpartition(".")[2]
    Refused.__doc__ = f"Not supported: {why}"
    return Refused


def module_getattr(module: str, why: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` that refuses every other name of DeepSpeed's module with ``why``."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise UnsupportedFeature(f"{module}.{name}: {why}")

    return __getattr__


INFERENCE = ("DeepSpeed's inference engine (kernel injection, tensor-parallel inference) is not offered: this package "
             "trains. For inference load the weights into your model (utils.zero_to_fp32, or engine.save_16bit_model) "
             "and run it with torch, or use DeepSpeed.")


def init_inference(model: Any = None, config: Any = None, **kwargs: Any) -> Any:
    """Not supported: raises ``UnsupportedFeature`` naming what to do instead."""
    raise UnsupportedFeature(f"init_inference: {INFERENCE}")
