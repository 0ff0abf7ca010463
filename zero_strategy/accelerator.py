"""``zero_strategy.accelerator``, as ``deepspeed.accelerator``: ``get_accelerator()`` (see
zero_strategy/deepspeed/accelerator.py)."""

from .deepspeed.accelerator import *  # noqa: F401,F403
from .deepspeed.accelerator import __all__  # noqa: F401
