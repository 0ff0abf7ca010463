"""The documentation: the site builds without a warning, every Python block of the README and the
guides runs, the README stays short and links every page, and the generators of the options and
design pages read the code as documented (docs/README.md says how the docs are written and tested)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from .doc_blocks import ROOT, SKIP_REASONS, blocks, pages

DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))

import zero_notes  # noqa: E402  (docs/_ext)
import zero_options  # noqa: E402

README_MAX_LINES = 220


# ---- the site --------------------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # Sphinx's notices to myst-parser, not ours
def test_the_site_builds_without_a_warning(tmp_path):
    from sphinx.cmd.build import build_main

    warnings = tmp_path / "warnings.txt"
    status = build_main(["-W", "--keep-going", "-q", "-j", "1", "-b", "html", "-w", str(warnings),
                         "-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")])
    assert status == 0, "the docs build failed:\n" + warnings.read_text()
    html = tmp_path / "html"
    assert (html / "index.html").is_file()
    options = (html / "options.html").read_text()
    assert all(f'id="option-{f.name.replace("_", "-")}"' in options for f in dataclasses.fields(_zero_config()))
    assert 'id="note-order-guard"' in (html / "design.html").read_text()


def _zero_config():
    from zero_strategy import ZeroConfig

    return ZeroConfig


# ---- the README and the pages --------------------------------------------------------------------


def test_the_readme_is_short_and_links_every_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES, "keep the README short: move details into a guide in docs/"
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)(?:#[\w-]*)?\)", readme))
    guides = {p.relative_to(ROOT).as_posix() for p in DOCS.glob("*.md")} - {"docs/index.md"}
    assert not guides - linked, f"pages the README does not link: {sorted(guides - linked)}"
    assert not linked - guides, f"README links to pages that do not exist: {sorted(linked - guides)}"


def test_skip_markers_name_a_known_reason_before_a_python_block():
    problems = [problem for page in pages() for problem in blocks(page)[1]]
    assert not problems, "\n".join(problems)


def test_commands_in_shell_blocks_are_console_scripts():
    scripts = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])
    used = {name for page in pages() for block in blocks(page)[0] if block.language in ("bash", "sh", "console")
            for name in re.findall(r"(?<![\w/.-])(zero-[a-z]+)\b", block.code)}
    assert {"zero-train", "zero-estimate", "zero-consolidate", "zero-launch"} <= used
    assert used <= scripts, f"commands the docs use that pyproject.toml does not install: {sorted(used - scripts)}"


def _runnable(page: Path) -> list[dict]:
    return [{"line": b.line, "code": b.code} for b in blocks(page)[0] if b.language == "python" and b.skip is None]


RUNNABLE = [p.relative_to(ROOT).as_posix() for p in pages() if _runnable(p)]


@pytest.fixture(scope="module")
def page_runs(tmp_path_factory):
    """Every page's Python blocks, run by one process (the imports of torch and Lightning are paid
    once): each page in a fresh namespace and an empty working directory of its own."""
    base = tmp_path_factory.mktemp("doc_blocks")
    spec = {"pages": []}
    for name in RUNNABLE:
        folder = base / name.replace("/", "_").removesuffix(".md")
        folder.mkdir()
        spec["pages"].append({"page": name, "dir": str(folder), "blocks": _runnable(ROOT / name)})
    (base / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": "",  # the blocks are written for a CPU; with a GPU "auto" would pick it
           "PYTHONUNBUFFERED": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "doc_blocks.py"), str(base / "spec.json"),
                          str(base / "results.json")], cwd=base, env=env, capture_output=True, text=True,
                         timeout=540)
    results = json.loads((base / "results.json").read_text()) if (base / "results.json").exists() else {}
    return results, run


@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", RUNNABLE)
def test_python_blocks_run(page, page_runs):
    results, run = page_runs
    if page not in results:
        pytest.fail(f"{page} did not run: the process ended (status {run.returncode}) before it.\n"
                    f"{(run.stdout + run.stderr)[-6000:]}")
    assert results[page]["error"] is None, results[page]["error"] + "\noutput:\n" + run.stdout[-3000:]


def test_every_page_with_code_has_a_python_block_that_runs():
    # a guide whose examples were all marked as skipped would test nothing: say so here
    for name in ("README.md", "docs/trainer.md", "docs/fabric.md", "docs/deepspeed.md", "docs/pretrained.md"):
        assert name in RUNNABLE


# ---- the generators (docs/_ext) ------------------------------------------------------------------


def test_notes_are_found_in_docstrings_and_comments_and_references_are_not_notes():
    source = textwrap.dedent('''
        """A module.

        [Note: first]
        Its text, which mentions [Note: second] in passing
        [Note: second] and wraps.

        More text of the first.

        [Note: third] (a parenthesis on the heading line)
        The third's text.
        """

        def f():
            """Do it; see [Note: first].

            [Note: in a function]
            Text.
            """
            # [Note: a comment]
            # Its text, on
            # two lines.
            x = 1  # [Note: first] here is a reference
            # [Note: first] starts this comment, as a reference: no sentence follows it
    ''')
    notes = zero_notes.notes_in_source(source, "pkg/mod.py")
    titles = [n.title for n in notes]
    assert titles == ["first", "third", "in a function", "a comment"]
    first = notes[0]
    assert first.line == 4 and "More text of the first." in first.text and "[Note: second] and wraps." in first.text
    assert notes[1].text.startswith("(a parenthesis on the heading line)\nThe third's text.")
    assert notes[3].text == "Its text, on\ntwo lines."


def test_the_package_defines_notes_with_unique_titles_per_file():
    notes = zero_notes.find_notes(ROOT / "zero_strategy")
    assert len(notes) > 50
    assert all(n.text for n in notes), [n for n in notes if not n.text]
    per_file = [(n.path, n.title) for n in notes]
    assert len(per_file) == len(set(per_file))


def test_options_take_the_doc_from_metadata_and_else_from_the_source():
    @dataclasses.dataclass(frozen=True)
    class Options:
        plain: int = 1
        """From the source."""

        documented: str = dataclasses.field(default="x", metadata={"doc": "From the metadata."})

        listed: tuple = dataclasses.field(default_factory=tuple)

    found = {o.name: o for o in zero_options.options(Options)}
    assert found["plain"] == zero_options.Option("plain", "int", "1", "From the source.")
    assert found["documented"].doc == "From the metadata."
    assert found["listed"].default == "()" and found["listed"].doc is None


def test_every_zero_config_field_has_a_doc():
    missing = [o.name for o in zero_options.options(_zero_config()) if not o.doc]
    assert not missing


def test_skip_reasons_are_documented():
    guide = (DOCS / "README.md").read_text()
    assert all(f"<!-- skip: {reason} -->" in guide for reason in SKIP_REASONS)
