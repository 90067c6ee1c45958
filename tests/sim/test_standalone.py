"""`kvguard sim-server`'s options: a value the simulator cannot run names its option."""

from __future__ import annotations

import argparse

import pytest

from kvguard.sim import standalone
from kvguard.sim.model.engine import EngineConfig


def _options(*argv: str) -> tuple[str, int, EngineConfig]:
    parser = argparse.ArgumentParser()
    standalone.add_arguments(parser)
    return standalone.options(parser.parse_args(["--listen", "127.0.0.1:0", *argv]))


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (
            ("--max-model-len", "0"),
            "--max-model-len must be from 2 to 8176, what 512 blocks of 16 tokens hold (one of "
            "them vLLM's null block)",
        ),
        (
            ("--blocks", "9", "--max-model-len", "129"),
            "--max-model-len must be from 2 to 128, what 9 blocks of 16 tokens hold (one of "
            "them vLLM's null block)",
        ),
        (("--speed", "inf"), "--speed must be a number above 0"),
        (("--speed", "nan"), "--speed must be a number above 0"),
        (("--speed", "0"), "--speed must be a number above 0"),
    ],
)
def test_an_option_the_simulator_cannot_run_is_named(argv: tuple[str, ...], error: str) -> None:
    with pytest.raises(ValueError) as info:
        _options(*argv)
    assert str(info.value) == error


def test_the_context_may_be_all_the_blocks_hold() -> None:
    host, port, engine = _options("--blocks", "9", "--max-model-len", "128", "--speed", "2")
    assert (host, port, engine.max_model_len, engine.usable_blocks) == ("127.0.0.1", 0, 128, 8)
