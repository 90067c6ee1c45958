"""Structured JSON logs on stderr: one object per line, with the request id and tenant where
there is one. Prompt text and credentials are never logged: decision lines carry counts only."""

from __future__ import annotations

import logging
import sys

from pythonjsonlogger.json import JsonFormatter

LEVELS = ("debug", "info", "warning", "error")


def configure(level: str = "info", *, json: bool = True) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if json:
        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s",
                rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            )
        )
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
