"""The command-line tools: ``zero-train`` (train.py) and ``zero-estimate`` (estimate.py), the Hydra
applications, and ``zero-consolidate`` (consolidate.py), which needs neither Hydra nor rich.

The Hydra tools need the ``[app]`` extra; their entry points below check for it first and say how
to install it, instead of failing deep in an import. ``configs.register_resolvers`` registers the
config resolvers the YAML files use (``${zero.auto_devices:}``) and the strategy presets' base node
(``strategy/zero_defaults``, made from ZeroConfig's fields); train.py and estimate.py call it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

_APP_PACKAGES = ("hydra", "omegaconf", "rich")


def _app(tool: str, module: str) -> int:
    """Run ``module``'s ``main`` (reading sys.argv) once the app's packages are there; 2 if not."""
    missing = [name for name in _APP_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        print(f"{tool}: error: {', '.join(missing)} not installed: the Hydra application needs the app extra, "
              "`pip install 'zero-strategy[app]'`.", file=sys.stderr)
        return 2
    return importlib.import_module(f"{__name__}.{module}").main() or 0


def train() -> int:
    """``zero-train``: see train.py."""
    return _app("zero-train", "train")


def estimate() -> int:
    """``zero-estimate``: see estimate.py."""
    return _app("zero-estimate", "estimate")
