"""kvguard's own API: proto/ is clean under `buf lint` (buf.yaml), and the generated code
matches it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_buf_lint_is_clean() -> None:
    buf = shutil.which("buf") or str(Path(sys.executable).parent / "buf")
    result = subprocess.run([buf, "lint"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_code_serves_the_proto_as_written() -> None:
    from kvguard.v1 import admin_pb2

    service = admin_pb2.DESCRIPTOR.services_by_name["AdminService"]
    assert [m.name for m in service.methods] == ["GetUsage", "ListLeases", "ReleaseLease"]
    assert "leases" in admin_pb2.PoolUsage.DESCRIPTOR.fields_by_name
