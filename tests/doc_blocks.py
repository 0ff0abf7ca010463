"""The code blocks of the README and the guides (docs/*.md): finding them, and running a page's
Python blocks in order, in one namespace, as a reader would (see docs/README.md, "Code blocks are
tests").

Run as a script, it runs the pages a JSON spec lists, one after the other in this process, each in
a fresh namespace and its own working directory, and writes each page's outcome to a JSON file
after every page: ``python doc_blocks.py SPEC.json RESULTS.json``.
"""

from __future__ import annotations

import json
import re
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
SKIP_REASONS = ("needs a GPU", "needs several processes")
"""The only reasons a Python block may be left out of the run, written on the line just before its
fence as ``<!-- skip: <reason> -->``."""
SKIP = re.compile(r"^\s*<!--\s*skip:\s*(?P<reason>.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")


@dataclass(frozen=True)
class Block:
    page: str  # the path relative to the repository root, e.g. "docs/trainer.md"
    line: int  # the 1-based line of the block's first line of code
    language: str
    code: str
    skip: Optional[str]  # the reason of a skip marker on the line before the fence


def pages() -> list[Path]:
    """README.md and every page of docs/ (not the built site)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(path: Path) -> tuple[list[Block], list[str]]:
    """The fenced blocks of a Markdown file, and the problems found with skip markers: a reason not
    in SKIP_REASONS, or a marker that is not right before a Python block's fence."""
    page = path.relative_to(ROOT).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    problems: list[str] = []
    i = 0
    while i < len(lines):
        marker = SKIP.match(lines[i])
        if marker:
            nxt = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
            if marker["reason"] not in SKIP_REASONS:
                problems.append(f"{page}:{i + 1}: unknown skip reason {marker['reason']!r}; the reasons are "
                                f"{SKIP_REASONS}")
            elif nxt is None or nxt["info"] != "python":
                problems.append(f"{page}:{i + 1}: a skip marker must be on the line just before a ```python fence")
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, language = opening["fence"], opening["info"]
        end = i + 1
        while end < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[end]):
            end += 1
        previous = SKIP.match(lines[i - 1]) if i > 0 else None
        found.append(Block(page, i + 2, language, "\n".join(lines[i + 1:end]) + "\n",
                           previous["reason"] if previous else None))
        i = end + 1
    return found, problems


def run_pages(spec_path: str, results_path: str) -> None:
    import os

    spec = json.loads(Path(spec_path).read_text())
    results_file = Path(results_path).resolve()  # the pages change the working directory
    results: dict[str, dict] = {}
    for page in spec["pages"]:
        os.chdir(page["dir"])
        namespace: dict = {"__name__": "__main__"}
        error = None
        start = time.perf_counter()
        for block in page["blocks"]:
            # the block's lines keep their numbers in the page, so a traceback names the page's line
            code = compile("\n" * (block["line"] - 1) + block["code"], page["page"], "exec")
            try:
                exec(code, namespace)
            except BaseException:  # noqa: B036 (SystemExit and KeyboardInterrupt fail a block too)
                error = f"the block at {page['page']}:{block['line']} raised:\n{traceback.format_exc()}"
                break
        results[page["page"]] = {"error": error, "seconds": round(time.perf_counter() - start, 2)}
        print(f"doc_blocks: {page['page']}: {'failed' if error else 'ok'} in {results[page['page']]['seconds']} s",
              flush=True)
        results_file.write_text(json.dumps(results))  # after every page: a crash keeps what ran


if __name__ == "__main__":
    run_pages(sys.argv[1], sys.argv[2])
