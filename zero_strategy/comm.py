"""``zero_strategy.comm``, as ``deepspeed.comm``: see zero_strategy/deepspeed/comm.py."""

from .deepspeed.comm import *  # noqa: F401,F403
from .deepspeed.comm import __all__  # noqa: F401
