"""Our half of the message for a bad command line: Hydra has just printed its error (it knows
what failed); this adds what to type instead (the options a group has, the key that was meant)."""

from __future__ import annotations

import difflib
import sys
from typing import Optional, Sequence

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from .configs import GROUPS, config_dir, group_options

# added to the hint when an option of the group does not exist
GROUP_NOTES = {
    "strategy": "Each preset is a ZeroStrategy (or Lightning's DDP) with some settings; any other setting is an "
                "override of its arguments, e.g. strategy=zero3 strategy.offload_optimizer=true.",
    "model": "model=gpt2 and model=bert need `pip install \"zero-strategy[models]\"` (transformers).",
}
# flags of Hydra's command line that are followed by a value, and so are not overrides
_FLAGS_WITH_VALUE = {"--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--cfg", "-c",
                     "--package", "-p", "--info", "-i", "--experimental-rerun"}


def split_command_line(argv: Sequence[str]) -> tuple[list[str], str]:
    """(overrides, config name) from zero-train's arguments; flags and their values left out."""
    overrides, config_name, skip = [], "train", False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg.startswith("-"):
            name = arg.split("=", 1)[0]
            if name in ("--config-name", "-cn"):
                config_name = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "train")
            skip = name in _FLAGS_WITH_VALUE and "=" not in arg
            continue
        overrides.append(arg)
    return overrides, config_name


def diagnose(overrides: Sequence[str], config_name: str = "train") -> list[str]:
    """Hints for overrides that cannot compose: unknown group options, unknown keys."""
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:  # noqa: BLE001 - Hydra has reported the syntax error itself
        return ["overrides look like key=value, group=option, +new_key=value or ~key; quote values "
                "that contain spaces or brackets, e.g. 'data.path=\"my notes.txt\"'."]
    hints, plain = [], []
    for o in parsed:
        group = o.get_key_element().lstrip("~+")
        if o.is_sweep_override():
            values = [str(v) for v in o.sweep_string_iterator()]
        else:
            values = [o.get_value_element_as_str()]
        if group in GROUPS and o.value_type is not None:
            options = group_options(group)
            for value in values:
                if value not in options and value != "null":
                    near = difflib.get_close_matches(value, options, n=1)
                    hint = f"{group}={value}: no such preset in conf/{group}/. Available: {', '.join(options)}."
                    if near:
                        hint += f" Did you mean {group}={near[0]}?"
                    if group in GROUP_NOTES:
                        hint += " " + GROUP_NOTES[group]
                    hints.append(hint)
        else:
            plain.append(o)
    if hints:
        return hints
    # the keys there are depend on the groups chosen: compose those alone, then look the keys up
    groups = [o.input_line for o in parsed if o not in plain and not o.is_sweep_override()]
    base = _compose(groups, config_name)
    if base is None:
        return hints
    for o in plain:
        key = o.get_key_element()
        if key.startswith(("+", "~", "hydra.")):
            continue
        if OmegaConf.select(base, key, default=_ABSENT, throw_on_resolution_failure=False) is not _ABSENT:
            continue
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(base, parent) if parent else base
        if not isinstance(node, DictConfig):
            hints.append(f"{key}: {parent or 'the config'} has no keys; check the spelling.")
            continue
        near = difflib.get_close_matches(leaf, [str(k) for k in node.keys()], n=3)
        options = f" Did you mean {', '.join(f'{parent}.{n}' if parent else n for n in near)}?" if near else ""
        hints.append(f"{key} is not in the config.{options} To add a new key, write +{o.input_line}.")
    return hints


_ABSENT = object()


def _compose(overrides: Sequence[str], config_name: str) -> Optional[DictConfig]:
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(config_dir()), version_base="1.3"):
            return compose(config_name, overrides=list(overrides))
    except Exception:  # noqa: BLE001 - the group options themselves failed; nothing more to add
        return None
    finally:
        GlobalHydra.instance().clear()


def explain_failure(argv: Sequence[str], program: str = "zero-train", config_name: Optional[str] = None) -> None:
    """Print our hints (if any) after Hydra's own error message."""
    overrides, named = split_command_line(argv)
    config_name = config_name or named
    try:
        hints = diagnose(overrides, config_name)
    except Exception:  # noqa: BLE001 - a diagnosis must never hide the original error
        return
    if hints:
        lines = [*hints, "`zero-train --help` lists every group and option."]
        print("\n" + "\n".join(f"{program}: {line}" for line in lines), file=sys.stderr)
