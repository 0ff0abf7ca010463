"""The Hydra applications: ``zero-train`` (train.py) and ``zero-estimate`` (estimate.py).

Importing this package registers the config resolvers the YAML files use (``${zero.auto_devices:}``).
"""

from .configs import config_dir, register_resolvers

register_resolvers()

__all__ = ["config_dir", "register_resolvers"]
