"""``zero_strategy.zero``, as ``deepspeed.zero``: ``Init`` and ``GatheredParameters`` (see
zero_strategy/deepspeed/zero_init.py)."""

from .deepspeed.zero_init import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init"]
