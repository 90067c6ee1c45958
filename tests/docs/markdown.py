"""Reading the project's Markdown pages: fenced blocks, tables, links and heading anchors.

Enough of GitHub's Markdown for the doc tests: fences of three or more backticks, pipe
tables, inline links, and GitHub's heading anchors.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def pages() -> list[Path]:
    """README.md and every page under docs/."""
    return [README, *sorted(DOCS.glob("*.md"))]


@dataclass(frozen=True)
class Block:
    """A fenced code block: its info string (`bash`, `text`, ...), its text and the line (from 1)
    of its opening fence."""

    info: str
    text: str
    line: int


_FENCE = re.compile(r"^(`{3,})(.*)$")


def split_fences(text: str) -> tuple[list[Block], list[tuple[int, str]]]:
    """The fenced blocks of `text`, and its other lines as (line number, line)."""
    blocks: list[Block] = []
    prose: list[tuple[int, str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        fence, info, start = opening.group(1), opening.group(2).strip(), i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        blocks.append(Block(info, "\n".join(body) + "\n" if body else "", start + 1))
        i += 1  # the closing fence
    return blocks, prose


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines of `text` outside fenced blocks, as (line number, line)."""
    return split_fences(text)[1]


def _cells(row: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", row.strip().strip("|"))
    return [cell.strip() for cell in cells]


def tables(text: str) -> list[list[list[str]]]:
    """Every pipe table outside fenced blocks: its rows (the header first, without the
    delimiter row), each a list of cells."""
    found: list[list[list[str]]] = []
    current: list[list[str]] = []
    for _, line in [*prose_lines(text), (0, "")]:
        if line.lstrip().startswith("|"):
            cells = _cells(line)
            if not all(re.fullmatch(r":?-+:?", cell) for cell in cells):
                current.append(cells)
        elif current:
            found.append(current)
            current = []
    return found


def tables_headed(text: str, *header: str) -> list[list[list[str]]]:
    """The rows below the header of every table whose header starts with `header`."""
    return [t[1:] for t in tables(text) if tuple(c.lower() for c in t[0][: len(header)]) == header]


def code_spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def headings(text: str) -> list[tuple[int, str]]:
    """(level, text) of every heading outside fenced blocks."""
    found = []
    for _, line in prose_lines(text):
        match = _HEADING.match(line)
        if match:
            found.append((len(match.group(1)), match.group(2)))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercase, punctuation other than `-`
    and `_` removed, spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").replace("*", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of the headings of `text`; a repeated heading's get -1, -2, ... as on
    GitHub."""
    seen: Counter[str] = Counter()
    found = set()
    for _, heading in headings(text):
        base = slug(heading)
        found.add(f"{base}-{seen[base]}" if seen[base] else base)
        seen[base] += 1
    return found


_LINK = re.compile(r"(?<!!)\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every inline link outside fenced blocks and code spans."""
    found: list[tuple[int, str]] = []
    for number, line in prose_lines(text):
        without_code = re.sub(r"`[^`]*`", "", line)
        found.extend((number, target) for target in _LINK.findall(without_code))
    return found


def section(text: str, heading: str) -> str:
    """The part of `text` under `heading` (its exact text), up to the next heading of the same
    level or above."""
    lines = text.splitlines()
    prose = dict(prose_lines(text))
    start, level = None, 0
    for number, line in enumerate(lines, 1):
        match = _HEADING.match(line) if number in prose else None
        if match is None:
            continue
        if start is None and match.group(2) == heading:
            start, level = number, len(match.group(1))
        elif start is not None and len(match.group(1)) <= level:
            return "\n".join(lines[start : number - 1]) + "\n"
    assert start is not None, f"no heading {heading!r}"
    return "\n".join(lines[start:]) + "\n"
