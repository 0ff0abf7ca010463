"""What DeepSpeed users bring along: their JSON configs (``config.py``, ``schedulers.py``).

Nothing is imported here, so ``import zero_strategy.deepspeed`` costs nothing; import the
modules themselves, e.g. ``from zero_strategy.deepspeed.config import map_deepspeed_config``.
"""
