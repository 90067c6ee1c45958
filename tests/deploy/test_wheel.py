"""The wheel: it carries the gRPC stubs and the demo's Envoy configuration, not the test support,
and kvguard runs from it alone, with no path back into the source tree."""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Run in the installed copy: imports every module named on the command line, then reports
# where each kvguard module and every module-level path came from, and renders the demo's
# Envoy configuration from the package data.
PROBE = """
import importlib, json, pathlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
import kvguard
from kvguard.sim import envoy
modules = {n: m for n, m in sys.modules.items() if n == "kvguard" or n.startswith("kvguard.")}
paths = {
    f"{n}.{attr}": str(value)
    for n, m in modules.items()
    for attr, value in vars(m).items()
    if isinstance(value, pathlib.PurePath)
}
print(json.dumps({
    "kvguard": kvguard.__file__,
    "files": {n: getattr(m, "__file__", None) for n, m in modules.items()},
    "paths": paths,
    "shipped_config": str(envoy.SHIPPED_CONFIG),
    "admin": envoy.loopback_config(1, 2)["admin"],
    "testing": importlib.util.find_spec("kvguard.testing") is not None,
}))
"""


def checkout_copy(dest: Path) -> Path:
    """The files of the checkout that git tracks or would track (generated stubs and build
    output left out, as in a fresh clone), copied to `dest`; symbolic links stay links."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if not os.path.lexists(source):  # deleted in the working tree, not yet in git
            continue
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target, follow_symlinks=False)
    return dest


def pip(*args: str | Path, cwd: Path) -> None:
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", *map(str, args)]
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    source = checkout_copy(work / "src")
    assert not list((source / "kvguard" / "v1").glob("*_pb2*")), "the stubs must be generated"
    pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", work, ".", cwd=source)
    (built,) = work.glob("kvguard-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("installed")
    pip("install", "--no-deps", "--no-index", "--target", target, wheel, cwd=target)
    return target


def run_installed(target: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python ARGS` with the installed copy and this venv's dependencies on sys.path, from a
    directory outside the checkout. -S: no site initialisation, so the venv's editable install
    (a .pth file pointing at the checkout) does not load."""
    path = [str(target), *site.getsitepackages()]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = os.pathsep.join(path)
    cwd = target.parent / f"{target.name}-cwd"
    cwd.mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, "-S", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def shipped_modules(wheel: Path) -> list[str]:
    """The dotted names of the wheel's modules (kvguard.__main__ left out: it runs the CLI)."""
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.startswith("kvguard/") and n.endswith(".py")]
    dotted = [n.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for n in names]
    return sorted(d for d in dotted if d != "kvguard.__main__")


def test_build_requires_the_locked_grpcio_tools() -> None:
    # The stubs it generates require a grpcio at least as new as itself: the lock's.
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    locked = re.search(r"^grpcio-tools==(\S+)", (ROOT / "requirements-dev.lock").read_text(), re.M)
    assert locked is not None
    assert f"grpcio-tools=={locked.group(1)}" in requires


def test_the_demos_envoy_configuration_is_the_shipped_file() -> None:
    # Package data for the demo, and the very file users deploy: a link, so it cannot drift.
    data = ROOT / "kvguard" / "sim" / "envoy.yaml"
    assert data.is_symlink()
    assert data.resolve() == (ROOT / "envoy" / "envoy.yaml").resolve()


@pytest.mark.integration
def test_the_wheel_carries_the_stubs_and_the_package_data_but_no_test_support(
    wheel: Path,
) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        shipped_config = archive.read("kvguard/sim/envoy.yaml")
    for stub in ("admin_pb2.py", "admin_pb2.pyi", "admin_pb2_grpc.py"):
        assert f"kvguard/v1/{stub}" in names
    assert shipped_config == (ROOT / "envoy" / "envoy.yaml").read_bytes()
    assert "kvguard/py.typed" in names
    lua = {str(p.relative_to(ROOT)) for p in (ROOT / "kvguard" / "ledger" / "lua").glob("*.lua")}
    assert lua and lua <= names
    assert not [n for n in names if n.startswith("kvguard/testing/")]
    # Every runtime module of the checkout is in it.
    modules = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "kvguard").rglob("*.py")
        if "testing" not in p.relative_to(ROOT / "kvguard").parts and "_pb2" not in p.name
    }
    assert modules <= names, sorted(modules - names)


@pytest.mark.integration
def test_kvguard_runs_from_the_installed_wheel_alone(wheel: Path, installed: Path) -> None:
    version = run_installed(installed, "-m", "kvguard", "--version")
    assert version.returncode == 0, version.stdout + version.stderr
    assert "0.1.0" in version.stdout + version.stderr

    probe = run_installed(installed, "-c", PROBE, *shipped_modules(wheel))
    assert probe.returncode == 0, probe.stdout + probe.stderr
    found: dict[str, Any] = json.loads(probe.stdout)
    package = installed / "kvguard"
    assert Path(found["kvguard"]).is_relative_to(package)
    outside = {n: f for n, f in found["files"].items() if f and not Path(f).is_relative_to(package)}
    assert outside == {}
    assert not found["testing"]
    # The demo's Envoy configuration is package data of the installed copy, and it renders.
    assert Path(found["shipped_config"]).is_relative_to(package)
    assert found["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    # A module-level absolute path is a file of the package; a relative one (the demo's
    # tokenizer folder, under the working directory) never names the checkout.
    for where, value in found["paths"].items():
        path = Path(value)
        if path.is_absolute():
            assert path.is_relative_to(package), (where, value)
        else:
            assert ".." not in path.parts, (where, value)


def test_the_installed_demo_asks_for_its_tokenizer_instead_of_failing(installed: Path) -> None:
    # Outside a checkout the default tokenizer folder is absent: a clear error, no traceback.
    demo = run_installed(installed, "-m", "kvguard", "demo", "--tokenizer", "no-such-folder")
    assert demo.returncode == 1, demo.stdout + demo.stderr
    assert "no tokenizer.json in" in demo.stderr and "--tokenizer DIR" in demo.stderr
    assert "Traceback" not in demo.stderr
    usage = run_installed(installed, "-m", "kvguard", "demo", "--help")
    assert usage.returncode == 0 and "--tokenizer DIR" in usage.stdout
