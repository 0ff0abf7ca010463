"""Where the configs live, and the resolvers they use.

[Note: where conf/ is] The design fixes conf/ at the top of the repository, beside the package,
so users find the configs where the template projects put them. A wheel has no "top of the
repository", so pyproject.toml maps the folder into the package as ``zero_strategy/conf``
(setuptools ``package-dir`` + ``package-data``): one source of truth, no copy to keep in sync.
``config_dir()`` therefore looks inside the installed package first, then beside it (a source
checkout or an editable install, where ``zero_strategy/conf`` does not exist).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

PACKAGE_DIR = Path(__file__).resolve().parents[1]
GROUPS = ("model", "data", "strategy", "trainer", "callbacks", "logger", "experiment")


def config_dir() -> Path:
    for candidate in (PACKAGE_DIR / "conf", PACKAGE_DIR.parent / "conf"):
        if (candidate / "train.yaml").is_file():
            return candidate
    raise FileNotFoundError(
        f"zero_strategy's configs are missing: neither {PACKAGE_DIR / 'conf'} (installed wheel) nor "
        f"{PACKAGE_DIR.parent / 'conf'} (source checkout) holds train.yaml; reinstall the package "
        "(pip install zero-strategy, or pip install -e . in a checkout)."
    )


def group_options(group: str) -> list[str]:
    """The options of a config group: the YAML files in conf/<group>/, without the suffix."""
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


def auto_devices() -> int:
    """``trainer.devices`` when nothing is said: every GPU there is; without one, 2 CPU processes,
    the smallest world in which ZeRO shards anything (and what a 2-core laptop can run)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def zero_defaults() -> dict[str, Any]:
    """The ``strategy/zero_defaults`` node: ZeroStrategy with every ZeroConfig option it takes at its
    default, read from the fields (see [Note: one source for each option] in config.py). The strategy
    presets build on it and list only what they change, and every option can be overridden as
    ``strategy.<name>=...`` without a ``+``."""
    from ..config import ZeroConfig

    options = {f.name: list(f.default) if isinstance(f.default, tuple) else f.default
               for f in dataclasses.fields(ZeroConfig) if f.metadata["argument"]}
    return {"_target_": "zero_strategy.ZeroStrategy", **options}


def register_resolvers() -> None:
    """The resolvers the YAML files use (``${zero.auto_devices:}``) and the config node made in code
    (``strategy/zero_defaults``); idempotent. Call it before composing conf/."""
    if not OmegaConf.has_resolver("zero.auto_devices"):
        OmegaConf.register_new_resolver("zero.auto_devices", auto_devices)
    ConfigStore.instance().store(group="strategy", name="zero_defaults", node=zero_defaults(),
                                 provider="zero_strategy")
