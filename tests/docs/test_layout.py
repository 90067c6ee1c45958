"""docs/design.md's layout names every package and every module under kvguard/.

The layout is the fenced block under "How the code is laid out": one entry per package
(`  admission/  ...`, continued on deeper-indented lines) or top-level module (`  app.py ...`).
A module counts as named when its bare file name (`decide.py`) is in its own package's entry;
a top-level module's when it is in any top-level entry (`cli.py ...;  errors.py ...`).

Not expected by name: `__init__.py` and `__main__.py` (the package's own entry stands for
them), and protoc's output (`*_pb2.py`, `*_pb2_grpc.py`), which the layout covers as `v1/`,
"generated from proto/".
"""

from __future__ import annotations

import re

from tests.docs.markdown import DOCS, ROOT, read, section, split_fences

DESIGN = DOCS / "design.md"
KVGUARD = ROOT / "kvguard"
_GENERATED = re.compile(r"_pb2(_grpc)?$")
_BARE_MODULE = re.compile(r"(?<![\w/.])(\w+)\.py\b")  # `decide.py`, not `ops/discovery.py`


def layout_entries() -> dict[str, str]:
    """The text of each entry under `kvguard/` in the layout, keyed by the entry's first word
    (`admission/`, `app.py`)."""
    blocks, _ = split_fences(section(read(DESIGN), "How the code is laid out"))
    tree = next(block.text for block in blocks if block.text.startswith("kvguard/\n"))
    entries: dict[str, str] = {}
    key = None
    for line in tree.splitlines()[1:]:
        if not line.startswith("  "):
            break  # the next top-level folder: envoy/, k8s/, ...
        if not line.startswith("   "):
            key = line.split()[0]
            entries[key] = ""
        assert key is not None
        entries[key] += line + "\n"
    return entries


def expected_modules() -> dict[str, list[str]]:
    """The modules under kvguard/ the layout must name, by the entry that must name them:
    `admission/` for kvguard/admission/decide.py, "" for kvguard/app.py."""
    expected: dict[str, list[str]] = {}
    for path in sorted(KVGUARD.rglob("*.py")):
        name = path.stem
        if name.startswith("__") or _GENERATED.search(name):
            continue
        package = path.parent.relative_to(KVGUARD).as_posix()
        expected.setdefault("" if package == "." else f"{package}/", []).append(f"{name}.py")
    return expected


def named_in(text: str) -> set[str]:
    return {f"{name}.py" for name in _BARE_MODULE.findall(text)}


def test_every_package_has_an_entry() -> None:
    packages = sorted(
        f"{path.parent.relative_to(KVGUARD).as_posix()}/" for path in KVGUARD.rglob("*/__init__.py")
    )
    missing = [package for package in packages if package not in layout_entries()]
    assert missing == [], f"packages missing from docs/design.md's layout: {missing}"


def test_every_module_is_named_in_its_package_entry() -> None:
    entries = layout_entries()
    top_level = "".join(text for key, text in entries.items() if not key.endswith("/"))
    missing = []
    for package, modules in expected_modules().items():
        named = named_in(entries.get(package, "") if package else top_level)
        missing += [f"kvguard/{package}{module}" for module in modules if module not in named]
    assert missing == [], f"modules missing from docs/design.md's layout: {missing}"
