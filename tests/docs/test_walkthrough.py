"""The README's hand-run walkthrough, run as written: the simulator, kvguard and Envoy on free
loopback ports, then each curl, checked against the output the README shows.

The walkthrough is the README's fenced blocks between `<!-- walkthrough -->` and
`<!-- /walkthrough -->`. Each ```bash block is a step, run in order in one bash process; a
```text block after a step is that step's output: each of its lines must appear in order among
the lines the step printed, `…` standing for any text.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.docs.markdown import README, ROOT, Block, split_fences

pytestmark = pytest.mark.integration  # the simulator, kvguard serve and Envoy, for real

START, END = "<!-- walkthrough -->", "<!-- /walkthrough -->"
PORTS = ("SIM_PORT", "KVGUARD_PORT", "METRICS_PORT", "ENVOY_PORT", "ENVOY_ADMIN_PORT")
DEADLINE_S = 120.0  # the whole walkthrough: starting three processes, seven requests, stopping
MARK = "@@walkthrough step {} done@@"


def walkthrough(text: str) -> list[tuple[str, str | None]]:
    """The steps of the walkthrough in `text`: (bash, the output shown after it, if any)."""
    assert text.count(START) == 1 and text.count(END) == 1, f"one {START} ... {END} section"
    section = text.split(START, 1)[1].split(END, 1)[0]
    steps: list[tuple[str, str | None]] = []
    fenced: list[Block] = split_fences(section)[0]
    for block in fenced:
        if block.info == "bash":
            steps.append((block.text, None))
        elif block.info == "text" and steps and steps[-1][1] is None:
            steps[-1] = (steps[-1][0], block.text)
        else:
            raise AssertionError(f"walkthrough line {block.line}: a ```{block.info} block")
    return steps


def shown_lines_missing(shown: str, printed: str) -> list[str]:
    """The lines of `shown` not found, in order, among the lines of `printed` (`…`: any text)."""
    actual = [line.rstrip() for line in printed.splitlines()]
    missing, position = [], 0
    for line in shown.splitlines():
        pattern = re.compile(".*".join(re.escape(part) for part in line.rstrip().split("…")))
        for index in range(position, len(actual)):
            if pattern.fullmatch(actual[index]):
                position = index + 1
                break
        else:
            missing.append(line)
    return missing


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def stop_group(process: subprocess.Popen[str]) -> None:
    """End the walkthrough's process group (its background jobs included): SIGTERM, then
    SIGKILL for whatever is left after a few seconds."""
    for sig, grace_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                return
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=0.1)


def test_the_walkthrough_shows_an_admitted_a_clamped_and_a_refused_request() -> None:
    shown = "\n".join(output or "" for _, output in walkthrough(README.read_text()))
    assert "HTTP/1.1 200 OK" in shown
    assert "x-kvguard-max-tokens:" in shown
    assert "HTTP/1.1 429 Too Many Requests" in shown
    assert "kvguard_admissions_total" in shown


def test_an_output_line_must_appear_in_order() -> None:
    assert shown_lines_missing("a\nb …\n", "x\na\nb 12\n") == []
    assert shown_lines_missing("b …\na\n", "a\nb 12\n") == ["a"]
    assert shown_lines_missing("HTTP/1.1 200 OK\n", "HTTP/1.1 429 Too Many Requests\n") != []


def test_the_walkthrough_runs_as_written(tmp_path: Path) -> None:
    steps = walkthrough(README.read_text())
    script = ["set -e -o pipefail"]
    for number, (bash, _) in enumerate(steps):
        script += [bash, f"printf '\\n%s\\n' '{MARK.format(number)}'"]
    path = tmp_path / "walkthrough.sh"
    path.write_text("\n".join(script) + "\n")
    env = {**os.environ, **dict(zip(PORTS, map(str, free_ports(len(PORTS))), strict=True))}
    env["TMPDIR"] = str(tmp_path)  # mktemp -d: the walkthrough's files stay in the test's folder
    process = subprocess.Popen(
        ["bash", str(path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: the background jobs end with it
    )
    try:
        printed, _ = process.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        stop_group(process)
        printed, _ = process.communicate()
        pytest.fail(f"the walkthrough did not end within {DEADLINE_S:g} s:\n{printed[-4000:]}")
    finally:
        stop_group(process)

    outputs = re.split(r"\n?@@walkthrough step \d+ done@@\n", printed)
    done = len(outputs) - 1
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in tmp_path.glob("*/*.log"))
    assert process.returncode == 0 and done == len(steps), (
        f"step {done} failed (exit {process.returncode}):\n{steps[min(done, len(steps) - 1)][0]}"
        f"\nprinted:\n{outputs[-1][-3000:]}\n{logs}"
    )
    for number, (bash, shown) in enumerate(steps):
        if shown is not None:
            missing = shown_lines_missing(shown, outputs[number])
            assert not missing, (
                f"step {number}:\n{bash}\ndid not print {missing}; it printed:\n{outputs[number]}"
            )
