"""Reinstall one locked package over whatever another package put in its place.

`xds-protos` ships its own, older copy of the `opentelemetry/proto/` modules, which overwrite
`opentelemetry-proto`'s when pip happens to install it later (the OTLP exporter then fails to
import). Reinstalling `opentelemetry-proto` last, hash-checked from the lock, puts the right
files back.

Usage: python tools/reinstall_from_lock.py LOCKFILE PACKAGE
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path


def requirement_block(lock: str, package: str) -> str:
    """The `package==version \\` line and its `--hash` lines, as the lock holds them."""
    match = re.search(rf"^{re.escape(package)}==\S+(?: \\\n\s+--hash=\S+)+", lock, re.MULTILINE)
    if match is None:
        raise SystemExit(f"{package} is not pinned with hashes in the lock file")
    return match.group(0).rstrip(" \\") + "\n"


def main(lock_path: str, package: str) -> None:
    block = requirement_block(Path(lock_path).read_text(), package)
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as requirements:
        requirements.write(block)
        requirements.flush()
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--force-reinstall",
             "--require-hashes", "-r", requirements.name],
            check=True,
        )  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:])
