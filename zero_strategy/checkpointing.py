"""``zero_strategy.checkpointing``, as ``deepspeed.checkpointing`` (see
zero_strategy/deepspeed/checkpointing.py)."""

from .deepspeed.checkpointing import *  # noqa: F401,F403
from .deepspeed.checkpointing import __all__  # noqa: F401
