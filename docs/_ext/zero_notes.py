"""Find the ``[Note: <title>]`` definitions in the package's source.

A Note is defined where a line of a string (usually a docstring) or of a block of ``#`` comments
begins with ``[Note: <title>]``, after a blank line or at the start of the string or block, and
the rest of that line is empty, a parenthesis, or a sentence (a capital letter). Its text runs to
the next definition or to the end of the string or comment block. A ``[Note: <title>]`` anywhere
else is a reference to one.
"""

from __future__ import annotations

import ast
import io
import re
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

NOTE_HEAD = re.compile(r"^\[Note: (?P<title>[^\]]+)\](?P<rest>(?:\s*| \(.*| [A-Z].*))$")
NOTE_REF = re.compile(r"\[Note:\s+(?P<title>[^\]]+?)\]")


@dataclass(frozen=True)
class Note:
    title: str
    path: str  # relative to the folder above the package, with "/" separators
    line: int  # 1-based line of the definition in the file
    text: str  # the Note's text, dedented, without the heading line's "[Note: ...]"


def normalise_title(title: str) -> str:
    """A title as written in a reference that may be wrapped across lines."""
    return " ".join(title.split())


def _blocks(source: str) -> Iterator[tuple[int, list[str]]]:
    """(first line number, lines) of each string literal and each run of comment lines."""
    comments: list[str] = []
    first = last = col = -1
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, column = tok.start
            if comments and row == last + 1 and column == col:
                comments.append(tok.string)
                last = row
                continue
            if comments:
                yield first, [c[1:][1:] if c[1:2] == " " else c[1:] for c in comments]
            comments, first, last, col = [tok.string], row, row, column
            continue
        if tok.type in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            continue
        if comments:
            yield first, [c[1:][1:] if c[1:2] == " " else c[1:] for c in comments]
            comments = []
        if tok.type == tokenize.STRING:
            try:
                value = ast.literal_eval(tok.string)
            except (ValueError, SyntaxError):  # an f-string
                continue
            if isinstance(value, str) and "[Note:" in value:
                yield tok.start[0], value.splitlines()
    if comments:
        yield first, [c[1:][1:] if c[1:2] == " " else c[1:] for c in comments]


def notes_in_source(source: str, path: str) -> list[Note]:
    notes = []
    for first_line, lines in _blocks(source):
        heads = [i for i, line in enumerate(lines)
                 if NOTE_HEAD.match(line.strip()) and (i == 0 or not lines[i - 1].strip())]
        for n, i in enumerate(heads):
            end = heads[n + 1] if n + 1 < len(heads) else len(lines)
            match = NOTE_HEAD.match(lines[i].strip())
            body = [match["rest"].strip()] if match["rest"].strip() else []
            body += lines[i + 1:end]
            text = textwrap.dedent("\n".join(body)).strip("\n").rstrip()
            notes.append(Note(normalise_title(match["title"]), path, first_line + i, text))
    return notes


def find_notes(package_dir: Path) -> list[Note]:
    """Every Note defined in ``package_dir/**/*.py``, sorted by path, then line."""
    notes = []
    for file in sorted(package_dir.rglob("*.py")):
        if "__pycache__" in file.parts:
            continue
        rel = file.relative_to(package_dir.parent).as_posix()
        notes += notes_in_source(file.read_text(encoding="utf-8"), rel)
    return sorted(notes, key=lambda n: (n.path, n.line))
