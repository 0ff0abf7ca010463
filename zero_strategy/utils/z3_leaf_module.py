"""``deepspeed.utils``' leaf-module names: a module flagged a leaf is one stage-3 unit with its whole
subtree, gathered at its forward (see [Note: leaf modules] in engine/params/plan.py). The flag is the
attribute DeepSpeed sets, ``_z3_leaf``, read when the engine plans the units; flag the modules before
``initialize`` (or the Trainer's or Fabric's setup). ``leaf_modules=[...]`` does the same by class."""

from __future__ import annotations

from typing import Sequence, Union

from torch import nn

from ..engine.params.plan import is_flagged_leaf

__all__ = ["get_z3_leaf_modules", "set_z3_leaf_modules", "unset_z3_leaf_modules", "z3_leaf_module",
           "z3_leaf_parameter"]


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether ``model`` is flagged a leaf."""
    return is_flagged_leaf(model)


def z3_leaf_parameter(model: nn.Parameter) -> bool:
    """Whether DeepSpeed marked ``model`` (a parameter) as a leaf module's: never here, where a leaf's
    parameters are its unit's like any other (the attribute DeepSpeed's engine sets is read too)."""
    return hasattr(model, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` flagged a leaf, in ``model.modules()`` order."""
    return [m for m in model.modules() if is_flagged_leaf(m)]


def _classes(leaf_module_classes: Sequence[Union[type, str]], name: str) -> list[Union[type, str]]:
    if isinstance(leaf_module_classes, (str, type)):
        leaf_module_classes = [leaf_module_classes]
    classes = list(leaf_module_classes)
    bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module)) and not isinstance(c, str)]
    if bad or not classes:
        raise ValueError(f"{name}: leaf_module_classes={leaf_module_classes!r} must be a non-empty list of module "
                         "classes or class names, e.g. [MoELayer] or ['MoELayer'].")
    return classes


def _flag(model: nn.Module, leaf_module_classes: Sequence[Union[type, str]], flag: bool, name: str,
          raise_if_not_found: bool) -> list[nn.Module]:
    classes = _classes(leaf_module_classes, name)

    def matches(module: nn.Module) -> bool:  # the exact class, as DeepSpeed compares ``module.__class__``
        return any(type(module) is c if isinstance(c, type) else type(module).__name__ == c for c in classes)

    found = [m for m in model.modules() if matches(m)]
    if not found and raise_if_not_found:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(f"{name}: no module of {type(model).__name__} is of the classes {classes}; its classes are "
                         f"{present}. Name one of them (the layer whose calls inside differ between ranks), or pass "
                         "raise_if_not_found=False.")
    for m in found:
        m._z3_leaf = flag
    return found


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: Sequence[Union[type, str]],
                        raise_if_not_found: bool = True) -> list[nn.Module]:
    """Flag every module of ``model`` whose class is one of ``leaf_module_classes`` (classes, or class
    names) a leaf; returns them. None found raises, unless ``raise_if_not_found`` is False."""
    return _flag(model, leaf_module_classes, True, "set_z3_leaf_modules", raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: Sequence[Union[type, str]],
                          raise_if_not_found: bool = True) -> list[nn.Module]:
    """Take the leaf flag off those modules again (before the engine plans its units)."""
    return _flag(model, leaf_module_classes, False, "unset_z3_leaf_modules", raise_if_not_found)
