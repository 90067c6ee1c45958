"""The import-linter layers contract (pyproject.toml) places every package and top-level module
of kvguard, so that a new one is checked where it lands instead of slipping past the layers."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATED = {"kvguard.v1"}  # the gRPC stubs, generated from proto/


def layered() -> set[str]:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c["layers"] for c in contracts["contracts"] if c["type"] == "layers"]
    return {name.strip() for layer in layers for name in layer.replace(":", "|").split("|")}


def test_every_package_and_top_level_module_has_a_layer() -> None:
    package = ROOT / "kvguard"
    found = {f"kvguard.{p.name}" for p in package.iterdir() if (p / "__init__.py").is_file()}
    found |= {f"kvguard.{p.stem}" for p in package.glob("*.py") if not p.name.startswith("__")}
    assert found - GENERATED - layered() == set()
    assert layered() - found == set()  # and names nothing that is gone
