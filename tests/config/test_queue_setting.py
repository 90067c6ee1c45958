"""`kvguard check-config` on pools[].queue.max_wait_seconds: a wait that, with the counting
budget, outlasts the shipped Envoy configurations' max_message_timeout is refused, naming the
key; the longest that fits passes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvguard.cli import main
from kvguard.config.schema import MAX_QUEUE_WAIT_S
from tests.cli import line_of
from tests.conftest import kvguard_config, write_config


def with_queue_wait(tmp_path: Path, seconds: float) -> Path:
    data = kvguard_config()
    data["pools"][0]["queue"] = {"max_wait_seconds": seconds}
    return write_config(tmp_path, data)


def test_a_wait_envoy_cannot_hold_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = with_queue_wait(tmp_path, 31)
    code = main(["check-config", str(path)])
    out, err = capsys.readouterr()
    assert code == 1
    assert out == ""
    assert err == (
        f"error: {path}: pools[0].queue.max_wait_seconds: at most 30: the wait and up to 5 s of "
        "counting must fit in the 35 s that the shipped Envoy configurations hold a message "
        f"for (max_message_timeout) (line {line_of(path, 'max_wait_seconds: 31')})\n"
    )


def test_the_longest_wait_envoy_holds_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = with_queue_wait(tmp_path, MAX_QUEUE_WAIT_S)
    code = main(["check-config", str(path)])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    assert f"{path}: ok" in out
