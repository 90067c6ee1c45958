"""docs/cli.md holds each command's `--help` verbatim, for every command there is.

The page shows each as a fenced ```text block beginning `usage: kvguard ...`; the test runs the
installed `kvguard` with that command and `--help`, 100 columns wide as the page says, and
compares the text. The commands are found by walking the real `--help` from the top.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.docs.markdown import DOCS, read, split_fences

PAGE = DOCS / "cli.md"
KVGUARD = Path(sys.executable).parent / "kvguard"  # the console script the install made
# The width the page's blocks were printed at; colour off, for Pythons whose argparse has it.
ENV = {**os.environ, "COLUMNS": "100", "NO_COLOR": "1", "PYTHON_COLORS": "0"}


def helps(commands: list[tuple[str, ...]]) -> dict[tuple[str, ...], str]:
    """`kvguard COMMAND --help` for each command, run side by side."""
    running = {
        command: subprocess.Popen(
            [str(KVGUARD), *command, "--help"],
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for command in commands
    }
    printed = {}
    for command, process in running.items():
        out, _ = process.communicate(timeout=60)
        assert process.returncode == 0, f"kvguard {' '.join(command)} --help:\n{out}"
        printed[command] = out
    return printed


def command_of(usage: str) -> tuple[str, ...]:
    """The command a usage line is for: `usage: kvguard ledger status [-h] ...` -> ("ledger",
    "status")."""
    words = usage.split()
    assert words[:2] == ["usage:", "kvguard"], usage
    command = []
    for word in words[2:]:
        if not re.fullmatch(r"[a-z][a-z-]*", word):
            break
        command.append(word)
    return tuple(command)


def documented(text: str) -> dict[tuple[str, ...], str]:
    """Command -> the `--help` text a page shows for it."""
    shown: dict[tuple[str, ...], str] = {}
    for block in split_fences(text)[0]:
        if block.info == "text" and block.text.startswith("usage: kvguard"):
            command = command_of(block.text.splitlines()[0])
            assert command not in shown, f"kvguard {' '.join(command)} is shown twice"
            shown[command] = block.text
    return shown


def every_command() -> dict[tuple[str, ...], str]:
    """Every command and subcommand of kvguard, with its `--help`, found from the top."""
    found: dict[tuple[str, ...], str] = {}
    pending: list[tuple[str, ...]] = [()]
    while pending:
        printed = helps(pending)
        found.update(printed)
        pending = []
        for command, text in printed.items():
            choices = re.search(r"\{([a-z,-]+)\}", text.splitlines()[0])
            if choices:
                pending += [(*command, name) for name in choices.group(1).split(",")]
    return found


def test_the_page_shows_every_commands_help_as_it_prints() -> None:
    shown, actual = documented(read(PAGE)), every_command()
    assert sorted(set(actual) - set(shown)) == [], "commands the page lacks"
    assert sorted(set(shown) - set(actual)) == [], "commands kvguard lacks"
    for command, text in actual.items():
        assert shown[command] == text, f"kvguard {' '.join(command)} --help differs"


def test_a_usage_line_names_its_command() -> None:
    assert command_of("usage: kvguard [-h] [--version] {serve,demo} ...") == ()
    assert command_of("usage: kvguard ledger status [-h] [--config CONFIG] [file]") == (
        "ledger",
        "status",
    )
    assert command_of("usage: kvguard sim-server [-h] [--listen LISTEN]") == ("sim-server",)


def test_a_stale_help_is_caught() -> None:
    page = read(PAGE).replace("requests per tenant", "requests for each tenant")
    assert page != read(PAGE)
    actual = helps([("demo",)])[("demo",)]
    assert documented(page)[("demo",)] != actual
