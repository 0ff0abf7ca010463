"""The options of ``ZeroConfig``, read from the code: ``dataclasses.fields(ZeroConfig)``.

Each field gives its name, type and default; its doc comes from ``field.metadata["doc"]`` where
the package provides it there, and otherwise from the attribute docstring written right under the
field in the class's source (read with ``ast``, since Python keeps no such docstring at run time).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Option:
    name: str
    type: str
    default: str  # as Python writes it; "(required)" when the field has no default
    doc: Optional[str]
    deepspeed: tuple[str, ...] = ()  # the DeepSpeed config keys, where the field's metadata names them


def attribute_docstrings(cls: type) -> dict[str, str]:
    """The attribute docstrings of ``cls``'s annotated fields, from its source: a string expression
    right after ``name: type = value`` in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = next(node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == cls.__name__).body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, str):  # the module uses ``from __future__ import annotations``
        return annotation
    return getattr(annotation, "__name__", None) or repr(annotation).replace("typing.", "")


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return repr(field.default)
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return repr(field.default_factory())  # type: ignore[misc]
    return "(required)"


def options(cls: type) -> list[Option]:
    """One ``Option`` per dataclass field of ``cls``, in the order the class declares them."""
    from_source: Optional[dict[str, str]] = None
    result = []
    for field in dataclasses.fields(cls):
        doc = field.metadata.get("doc")
        if doc is None:
            if from_source is None:
                from_source = attribute_docstrings(cls)
            doc = from_source.get(field.name)
        keys = field.metadata.get("deepspeed") or ()
        result.append(Option(field.name, _type_name(field.type), _default(field),
                             inspect.cleandoc(doc) if doc else None,
                             (keys,) if isinstance(keys, str) else tuple(keys)))
    return result
