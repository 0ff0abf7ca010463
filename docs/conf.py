"""Sphinx configuration of the zero_strategy documentation (Markdown, through myst-parser).

Build: ``python -m sphinx -W -b html docs docs/_build/html`` from the repository root. The build
is strict: any warning fails it, including a reference or a link between pages that resolves to
nothing. It reads nothing from the network (no intersphinx, no link check).
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
# the checkout's package, not whichever zero_strategy the environment installed; and the extensions
sys.path[:0] = [str(ROOT), str(DOCS / "_ext")]

project = "zero_strategy"
author = "the zero_strategy authors"
copyright = "the zero_strategy authors"  # noqa: A001 (Sphinx's name)

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "zero_docs",  # docs/_ext/zero_docs.py: the options and design pages, generated from the code
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext"]

# ---- strictness -------------------------------------------------------------------------------
# Every cross reference must resolve. References into other projects (torch, Lightning, the standard
# library's typing) would need intersphinx, which fetches their inventories over the network, so
# those, and only those, are let through unresolved.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|lightning|transformers|peft|argparse|collections|contextlib|datetime|os|pathlib|types"
               r"|typing|typing_extensions)(\..*)?"),
    (r"py:.*", r"(Any|Optional|Union|Callable|Iterable|Iterator|Sequence|Mapping|Literal|PathLike|Tensor|Module"
               r"|Parameter|Optimizer|Path|TracebackType|timedelta|nn\..*|torch)"),
    (r"py:.*", r"(int|float|str|bool|bytes|dict|list|tuple|set|type|object|None|NoneType|Ellipsis|\.\.\.)"),
    # the package's own types that are not public (a return value's class, a base class): they live in
    # submodules that are being reorganised, so the API pages neither document nor link them
    (r"py:.*", r"zero_strategy\.[a-z_]+\..+"),
]

# myst: links between pages are checked (a link to a missing page or heading is a warning, which -W
# makes an error); only links with a scheme (https://...) are taken as external, and never fetched.
myst_all_links_external = False
myst_heading_anchors = 3
myst_enable_extensions = ["deflist"]

# ---- autodoc ------------------------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = False  # True reads defaults from the source, which a signature made from the fields has not

# ---- html -----------------------------------------------------------------------------------------
html_theme = "alabaster"
html_title = "zero_strategy"
html_theme_options = {"description": "ZeRO stage 1/2/3 for PyTorch Lightning", "fixed_sidebar": False}
html_static_path: list[str] = []
