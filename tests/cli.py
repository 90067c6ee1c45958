"""The kvguard command as a real process: its command line, a run to completion, a trace to
simulate, and the line of a file that a message points to."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

TRACE = Path(__file__).parent / "data" / "traces" / "vtc_lmsys_head80.csv"


def kvguard(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvguard", *args]


async def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *kvguard(*args),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=None if env is None else {**os.environ, **env},
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), 60)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def line_of(path: Path, text: str) -> int:
    """The line (from 1) of the file's last line that holds `text`."""
    lines = path.read_text(errors="replace").splitlines()
    return max(i for i, line in enumerate(lines, 1) if text in line)
