"""Every relative link of README.md and docs/*.md resolves, its #anchor included, and every
repository path a page names in code (`kvguard/ops/metrics.py`) exists."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from tests.docs.markdown import (
    DOCS,
    README,
    ROOT,
    anchors,
    links,
    pages,
    prose_lines,
    read,
    split_fences,
)

# Top-level folders whose paths the pages name in code spans.
TREE = ("kvguard", "tests", "bench", "tools", "k8s", "envoy", "proto", "docs")
_PATH = re.compile(rf"(?:{'|'.join(TREE)})/[\w./-]*")
DESIGN = DOCS / "design.md"


def page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def broken_links(page: Path) -> list[str]:
    """`line: target (why)` for each relative link of `page` that does not resolve."""
    broken = []
    for line, target in links(read(page)):
        parts = urlsplit(target)
        if parts.scheme or parts.netloc or target.startswith("mailto:"):
            continue  # absolute: not checked here
        destination = (page.parent / unquote(parts.path)).resolve() if parts.path else page
        if not destination.exists():
            broken.append(f"{line}: {target} (no such file)")
        elif (
            parts.fragment
            and destination.suffix == ".md"
            and parts.fragment not in anchors(read(destination))
        ):
            broken.append(f"{line}: {target} (no such heading)")
    return broken


@pytest.mark.parametrize("page", pages(), ids=page_id)
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


@pytest.mark.parametrize("page", pages(), ids=page_id)
def test_paths_named_in_code_exist(page: Path) -> None:
    missing = []
    for line, text in prose_lines(read(page)):
        for span in re.findall(r"`([^`]+)`", text):
            if _PATH.fullmatch(span) and not (ROOT / span).exists():
                missing.append(f"{line}: {span}")
    assert missing == []


def test_the_readme_links_every_docs_page() -> None:
    linked = {
        (README.parent / urlsplit(target).path).resolve()
        for _, target in links(read(README))
        if not urlsplit(target).scheme
    }
    assert [page_id(p) for p in pages()[1:] if p.resolve() not in linked] == []


def test_a_broken_link_or_anchor_is_found(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## Its `second` part\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md) [ok](other.md#its-second-part) [ok](#page)\n"
        "[gone](missing.md) [no heading](other.md#nowhere) [here](#nowhere)\n"
        "`[not a link](missing.md)`\n\n```\n[in a block](missing.md)\n```\n"
    )
    assert broken_links(page) == [
        "4: missing.md (no such file)",
        "4: other.md#nowhere (no such heading)",
        "4: #nowhere (no such heading)",
    ]


def layout_modules(block: str) -> list[str]:
    """The modules a `kvguard/` tree drawing names, as paths: each `name.py` on a package's
    lines (`  ledger/  ... memory.py`) is in that package, on a module's own line at the top."""
    named, package = [], ""
    for line in block.splitlines()[1:]:
        entry = re.match(r"  (\S+)", line)
        if not line.startswith(" "):
            break  # past the kvguard/ tree
        if entry:
            package = entry.group(1) if entry.group(1).endswith("/") else ""
        named += [f"kvguard/{package}{name}" for name in re.findall(r"\b(\w+\.py)\b", line)]
    return named


def test_the_layout_names_existing_modules() -> None:
    (layout,) = [b.text for b in split_fences(read(DESIGN))[0] if b.text.startswith("kvguard/\n")]
    named = layout_modules(layout)
    assert "kvguard/admission/leases.py" in named and "kvguard/cli.py" in named
    assert [path for path in named if not (ROOT / path).is_file()] == []


def test_the_layout_names_every_package_and_top_level_module() -> None:
    (layout,) = [b.text for b in split_fences(read(DESIGN))[0] if b.text.startswith("kvguard/\n")]
    lines = layout.split("\n")[1:]
    tree = lines[: next((i for i, line in enumerate(lines) if not line.startswith(" ")), None)]
    packages = {m.group(1) for line in tree if (m := re.match(r"  (\w+)/", line))}
    named = set(layout_modules(layout))
    package_dir = ROOT / "kvguard"
    assert packages >= {p.name for p in package_dir.iterdir() if (p / "__init__.py").is_file()}
    top = {f"kvguard/{p.name}" for p in package_dir.glob("*.py") if not p.name.startswith("__")}
    assert top - named == set()
