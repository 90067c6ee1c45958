"""Logging never blocks its caller, even when stderr does (kvguard.ops.logs)."""

from __future__ import annotations

import json
import select
import subprocess
import sys

from kvguard.ops.logs import MAX_QUEUED_RECORDS

CHILD = """
import logging, sys
from kvguard.ops import logs
from kvguard.testing.wait import wait_until_sync
logs.configure("info")
log = logging.getLogger("test")
for i in range(int(sys.argv[1])):
    log.info("line %d %s", i, "x" * 150)
print("logged", flush=True)
sys.stdin.readline()  # the parent reads stderr from now on
wait_until_sync(lambda: not logs._lines.lines, "the queued lines to be written", timeout_s=30)
log.info("last")
"""


def _child(code: str, *args: str) -> subprocess.Popen[str]:
    """A Python child running `code`, every stream a pipe; nobody reads its stderr yet."""
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _says(child: subprocess.Popen[str], line: str, failure: str) -> None:
    """Wait (60 s at most) for `line` on the child's stdout."""
    ready, _, _ = select.select([child.stdout], [], [], 60)
    assert ready, failure
    assert child.stdout is not None and child.stdout.readline() == line + "\n"


def test_a_blocked_stderr_neither_blocks_the_caller_nor_loses_count() -> None:
    sent = MAX_QUEUED_RECORDS + 2_000  # more than the queue and the pipe (64 KiB) hold
    child = _child(CHILD, str(sent))
    try:
        # A logger that wrote on the caller's thread would stop once the pipe is full, and
        # never print "logged".
        _says(child, "logged", "logging blocked while stderr was full")
        _, err = child.communicate("go\n", timeout=60)
    finally:
        child.kill()
    records = [json.loads(line) for line in err.splitlines()]
    written = [r for r in records if r["message"].startswith("line ")]
    (dropped,) = [r for r in records if "log records dropped" in r["message"]]
    lost = int(dropped["message"].split()[0])
    assert lost > 0 and len(written) + lost == sent
    assert [int(r["message"].split()[1]) for r in written] == list(range(len(written)))
    assert records[-1]["message"] == "last"


STUCK = """
import logging, sys
from kvguard.ops import logs
logs.configure("info")
logs.STOP_TIMEOUT_S = 0.2
for i in range(logs.MAX_QUEUED_RECORDS + 2_000):
    logging.getLogger("test").info("line %d %s", i, "x" * 150)
logs.stop()  # stderr stays blocked: gives up instead of hanging, and does not raise
print("stopped", flush=True)
"""


def test_stopping_gives_up_on_a_stderr_that_stays_blocked() -> None:
    child = _child(STUCK)
    try:
        _says(child, "stopped", "stop() hung on a blocked stderr")
        child.communicate(timeout=60)  # reading stderr lets it exit
        assert child.returncode == 0
    finally:
        child.kill()
