"""Check a composed config before anything is instantiated or launched.

Hydra checks that overrides name existing keys and group options; it does not know what the
``_target_`` classes accept (no schema), so a mistyped argument or a wrong type would surface
later as a TypeError deep inside Lightning, on every rank. Here each ``_target_`` node is
compared with its target's signature: unknown argument names, values whose type the
annotation rules out, and required values left at ``???``. Annotations this cannot judge
(classes, callables) are accepted.
"""

from __future__ import annotations

import difflib
import inspect
import typing
from typing import Any, Iterator, Optional, Sequence

from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

_HYDRA_KEYS = {"_target_", "_partial_", "_recursive_", "_convert_", "_args_"}


class ConfigError(ValueError):
    """A bad value in the composed config: the message names the key, the value and the fix."""


def _nodes_with_target(node: Any, path: str) -> Iterator[tuple[str, DictConfig]]:
    if isinstance(node, DictConfig):
        if "_target_" in node:
            yield path, node
        for key in node:
            yield from _nodes_with_target(node._get_node(key), f"{path}.{key}" if path else str(key))
    elif isinstance(node, ListConfig):
        for i in range(len(node)):
            yield from _nodes_with_target(node._get_node(i), f"{path}[{i}]")


def _missing_keys(node: Any, path: str) -> Iterator[str]:
    """Keys left at ``???``, found without resolving anything (an unrelated broken interpolation
    must not hide them; OmegaConf.missing_keys resolves as it walks)."""
    if isinstance(node, DictConfig):
        for key in node:
            full = f"{path}.{key}" if path else str(key)
            if OmegaConf.is_missing(node, key):
                yield full
            else:
                yield from _missing_keys(node._get_node(key), full)


def _accepts(annotation: Any, value: Any) -> Optional[bool]:
    """True/False when the annotation decides, None when it cannot be judged from a config value."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return None
    origin = typing.get_origin(annotation)
    if origin is typing.Union or type(annotation).__name__ == "UnionType":
        verdicts = [_accepts(a, value) for a in typing.get_args(annotation)]
        return True if any(verdicts) else (None if None in verdicts else False)
    if origin is typing.Literal:
        return value in typing.get_args(annotation) or str(value) in map(str, typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin in (list, tuple, typing.Sequence) or annotation in (list, tuple):
        return isinstance(value, (ListConfig, list, tuple)) or None
    if origin is dict or annotation is dict:
        return isinstance(value, (DictConfig, dict)) or None
    return None


def _describe(annotation: Any) -> str:
    text = str(annotation).replace("typing.", "")
    return annotation.__name__ if isinstance(annotation, type) else text


def _check_node(path: str, node: DictConfig, problems: list[str]) -> None:
    target_name = node["_target_"]
    try:
        target = get_object(target_name)
    except Exception as err:  # noqa: BLE001 - reported as a config problem, with the reason
        problems.append(f"{path}._target_={target_name!r} cannot be imported ({type(err).__name__}: {err})")
        return
    try:
        signature = inspect.signature(target)
        hints = typing.get_type_hints(target.__init__ if inspect.isclass(target) else target)
    except (TypeError, ValueError, NameError):
        return  # no signature or unresolvable annotations: nothing to check against
    params = signature.parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for key in node:
        if key in _HYDRA_KEYS:
            continue
        if key not in params:
            if not takes_kwargs:
                near = difflib.get_close_matches(str(key), list(params), n=1)
                hint = f" Did you mean {path}.{near[0]}?" if near else ""
                problems.append(f"{path}.{key} is not an argument of {target_name}; it takes "
                                f"{', '.join(params)}.{hint}")
            continue
        if OmegaConf.is_missing(node, key):
            continue  # reported by the missing-value check
        value = node._get_node(key)
        if isinstance(value, DictConfig) and "_target_" in value:
            continue  # built by Hydra first; its own node is checked separately
        try:
            plain = OmegaConf.to_object(value) if isinstance(value, (DictConfig, ListConfig)) else node[key]
        except InterpolationResolutionError as err:
            problems.append(_unresolvable(f"{path}.{key}", value, err))
            continue
        annotation = hints.get(key, params[key].annotation)
        if _accepts(annotation, plain) is False:
            problems.append(f"{path}.{key}={plain!r} ({type(plain).__name__}) does not fit {target_name}'s "
                            f"{key}: {_describe(annotation)}")


def _unresolvable(key: str, node: Any, err: Exception) -> str:
    text = f"{key}={node._value()} cannot be resolved: {str(err).splitlines()[0]}"
    if "${data." in str(node._value()):
        text += (". The model reads this from the data config, so this model and data set do not fit "
                 "together: language models (gpt, gpt2) need data with seq_len (stdlib, text, synthetic); "
                 "mlp needs gaussian; bert needs corrupted_source (a model preset selects its data by default)")
    return text


def check_config(cfg: DictConfig, sections: Optional[Sequence[str]] = None) -> None:
    """Raise ConfigError listing every problem found (all at once, not one per run); only in
    ``sections`` (top-level keys) when given."""
    missing = [key for key in _missing_keys(cfg, "") if sections is None or key.split(".")[0] in sections]
    problems = [f"{key} is required but not set (it is ??? in the config); pass {key}=..." for key in missing]
    for path, node in _nodes_with_target(cfg, ""):
        if sections is None or path.split(".")[0] in sections:
            _check_node(path, node, problems)
    if problems:
        raise ConfigError("the composed config has problems:\n  - " + "\n  - ".join(problems)
                          + "\nFix them with overrides (key=value), or show the config with `zero-train --cfg job`.")
