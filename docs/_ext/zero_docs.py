"""Sphinx extension for this project's pages generated from the code at build time.

- ``zero-options``: the options page, one entry per field of ``zero_strategy.ZeroConfig``
  (see zero_options.py).
- ``zero-notes``: the design page, every ``[Note: <title>]`` defined in the package's source
  (see zero_notes.py), grouped by file.
- At the end of reading, every public name of ``zero_strategy`` (its ``__all__``) must have an API
  entry as ``zero_strategy.<name>``; one missing is a warning, which ``-W`` makes an error.

Text from the code is set as plain text: ````literal```` spans become literals and a
``[Note: <title>]`` that names a defined Note becomes a link to it; nothing else is parsed, so
no docstring can break the build with markup it did not mean.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

from docutils import nodes
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

from zero_notes import NOTE_REF, Note, find_notes, normalise_title
from zero_options import options

logger = logging.getLogger(__name__)

GENERATED_DOCS = ("options", "design")  # re-read on every build: their source is the code
INLINE = re.compile(r"``(?P<literal>.+?)``|" + NOTE_REF.pattern, re.S)
BULLET = re.compile(r"^(\s*)[-*] ")


def _package_dir() -> Path:
    import zero_strategy

    return Path(zero_strategy.__file__).resolve().parent


_NOTES: list[Note] = []  # the package's Notes, read once per build (see _read_notes)


def _read_notes(app: Sphinx) -> None:
    _NOTES[:] = find_notes(_package_dir())


def _notes() -> list[Note]:
    if not _NOTES:
        _NOTES[:] = find_notes(_package_dir())
    return _NOTES


def note_labels(notes: list[Note]) -> dict[Note, str]:
    """A label per Note: ``note-<title>``, and for a title defined again in another file
    ``note-<title>-<path>``. References by title go to the first definition."""
    labels: dict[Note, str] = {}
    seen: set[str] = set()
    for note in notes:
        label = nodes.make_id(f"note-{note.title}")
        if label in seen:
            label = nodes.make_id(f"note-{note.title}-{note.path}")
        seen.add(label)
        labels[note] = label
    return labels


def first_label_by_title(notes: list[Note]) -> dict[str, str]:
    labels = note_labels(notes)
    by_title: dict[str, str] = {}
    for note in notes:
        by_title.setdefault(note.title, labels[note])
    return by_title


def inline_nodes(text: str, by_title: dict[str, str], docname: str = "") -> list[nodes.Node]:
    """``text`` as text nodes, with ````literal```` spans as literals and references to known Notes as
    links (a ``pending_xref`` to the design page's label, resolved and checked by Sphinx)."""
    result: list[nodes.Node] = []
    pos = 0
    for match in INLINE.finditer(text):
        result.append(nodes.Text(text[pos:match.start()]))
        pos = match.end()
        if match["literal"] is not None:
            result.append(nodes.literal(text=" ".join(match["literal"].split())))
            continue
        title = normalise_title(match["title"])
        label = by_title.get(title)
        if label is None:  # a reference to no Note: left as written
            result.append(nodes.Text(match.group(0)))
            continue
        ref = addnodes.pending_xref("", refdomain="std", reftype="ref", reftarget=label, refexplicit=True,
                                    refdoc=docname, refwarn=True)
        ref += nodes.inline(text=f"[Note: {title}]")
        result.append(ref)
    result.append(nodes.Text(text[pos:]))
    return result


def block_nodes(text: str, by_title: dict[str, str], docname: str) -> list[nodes.Node]:
    """``text``'s paragraphs (separated by blank lines) as paragraphs, and runs of ``- `` lines as
    bullet lists (an item's indented lines continue it)."""
    result: list[nodes.Node] = []
    for chunk in re.split(r"\n\s*\n", text.strip("\n")):
        lines = chunk.splitlines()
        prose: list[str] = []
        items: list[list[str]] = []
        for line in lines:
            if BULLET.match(line):
                items.append([BULLET.sub("", line, count=1)])
            elif items:
                items[-1].append(line.strip())
            else:
                prose.append(line.strip())
        if prose:
            result.append(nodes.paragraph("", "", *inline_nodes(" ".join(prose), by_title, docname)))
        if items:
            bullets = nodes.bullet_list()
            for item in items:
                bullets += nodes.list_item("", nodes.paragraph("", "", *inline_nodes(" ".join(item), by_title,
                                                                                      docname)))
            result.append(bullets)
    return result


def _section(document: Any, title: nodes.Node, label: str) -> nodes.section:
    section = nodes.section(ids=[label], names=[label])
    section += nodes.title("", "", title)
    document.note_explicit_target(section)
    return section


class OptionsDirective(SphinxDirective):
    """Every field of ZeroConfig: a table of name, type and default, then a section per field."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        from zero_strategy import ZeroConfig, ZeroFabricStrategy, ZeroStrategy

        self.env.note_dependency(str(_package_dir() / "config.py"))
        takes = {cls.__name__: set(inspect.signature(cls).parameters) for cls in (ZeroStrategy, ZeroFabricStrategy)}
        by_title = first_label_by_title(_notes())
        found = options(ZeroConfig)
        table = nodes.table(classes=["zero-options"])
        group = nodes.tgroup(cols=3)
        table += group
        for width in (3, 3, 2):
            group += nodes.colspec(colwidth=width)
        head = nodes.thead()
        group += head
        head += nodes.row("", *(nodes.entry("", nodes.paragraph(text=h)) for h in ("option", "type", "default")))
        body = nodes.tbody()
        group += body
        sections = []
        for option in found:
            label = nodes.make_id(f"option-{option.name}")
            ref = nodes.reference("", "", nodes.literal(text=option.name), refid=label, internal=True)
            body += nodes.row("", nodes.entry("", nodes.paragraph("", "", ref)),
                              nodes.entry("", nodes.paragraph("", "", nodes.literal(text=option.type))),
                              nodes.entry("", nodes.paragraph("", "", nodes.literal(text=option.default))))
            section = _section(self.state.document, nodes.literal(text=option.name), label)
            facts = [nodes.Text("Type "), nodes.literal(text=option.type),
                     nodes.Text(", default "), nodes.literal(text=option.default), nodes.Text(".")]
            if option.deepspeed:
                facts.append(nodes.Text(" DeepSpeed config: "))
                for i, key in enumerate(option.deepspeed):
                    facts += [nodes.Text(", " if i else ""), nodes.literal(text=key)]
                facts.append(nodes.Text("."))
            not_taken = [name for name, parameters in takes.items() if option.name not in parameters]
            if not_taken:
                facts.append(nodes.Text(f" Not an argument of {' or '.join(not_taken)}: set from elsewhere "
                                        "(see the description)."))
            section += nodes.paragraph("", "", *facts)
            if option.doc:
                section += block_nodes(option.doc, by_title, self.env.docname)
            else:
                logger.warning("ZeroConfig.%s has no doc: write one under the field", option.name,
                               location=self.get_location())
            sections.append(section)
        return [table, *sections]


class NotesDirective(SphinxDirective):
    """Every Note of the package: an index of titles, then a section per file with a section per Note."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        package = _package_dir()
        notes = _notes()
        for file in sorted(package.rglob("*.py")):
            self.env.note_dependency(str(file))
        if not notes:
            logger.warning("no [Note: ...] found under %s", package, location=self.get_location())
            return []
        labels = note_labels(notes)
        by_title = first_label_by_title(notes)
        index = nodes.bullet_list(classes=["zero-notes-index"])
        for note in sorted(notes, key=lambda n: (n.title.lower(), n.path)):
            ref = nodes.reference("", "", nodes.Text(note.title), refid=labels[note], internal=True)
            index += nodes.list_item("", nodes.paragraph("", "", ref, nodes.Text(" ("),
                                                         nodes.literal(text=note.path), nodes.Text(")")))
        index_section = _section(self.state.document, nodes.Text("Every Note, by title"), "notes-by-title")
        index_section += index
        result = [index_section]
        by_file: dict[str, list[Note]] = {}
        for note in notes:
            by_file.setdefault(note.path, []).append(note)
        for path, in_file in by_file.items():
            file_section = _section(self.state.document, nodes.literal(text=path), nodes.make_id(f"file-{path}"))
            for note in in_file:
                section = _section(self.state.document, nodes.Text(note.title), labels[note])
                section += nodes.paragraph("", "", nodes.literal(text=f"{note.path}:{note.line}"))
                section += block_nodes(note.text, by_title, self.env.docname)
                file_section += section
            result.append(file_section)
        return result


def _link_notes_in_docstrings(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """autodoc: a ``[Note: <title>]`` within one line of a docstring that names a defined Note becomes a
    link to it on the design page (docstrings are reStructuredText)."""
    by_title = first_label_by_title(_notes())

    def link(match: re.Match) -> str:
        label = by_title.get(normalise_title(match["title"]))
        return match.group(0) if label is None else f":ref:`[Note: {match['title']}] <{label}>`"

    lines[:] = [NOTE_REF.sub(link, line) for line in lines]


def _always_outdated(app: Sphinx, env: BuildEnvironment, added: set, changed: set, removed: set) -> list[str]:
    return [doc for doc in GENERATED_DOCS if doc in env.found_docs]


def _check_api(app: Sphinx, env: BuildEnvironment) -> None:
    """Every public name of zero_strategy must be documented as ``zero_strategy.<name>``."""
    import zero_strategy

    documented = set(env.get_domain("py").objects)  # type: ignore[attr-defined]
    missing = [name for name in zero_strategy.__all__ if f"zero_strategy.{name}" not in documented]
    if missing:
        logger.warning("public names of zero_strategy without an API entry (add them to docs/api.md): %s",
                       ", ".join(missing))


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("zero-options", OptionsDirective)
    app.add_directive("zero-notes", NotesDirective)
    app.connect("builder-inited", _read_notes)
    app.connect("autodoc-process-docstring", _link_notes_in_docstrings)
    app.connect("env-get-outdated", _always_outdated)
    app.connect("env-check-consistency", _check_api)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
