"""Request traces: token counts and arrival times, read from CSV or JSON lines.

The format is told by the header (the keys of the first JSON line):

| format | columns |
|---|---|
| azure2023 | TIMESTAMP, ContextTokens, GeneratedTokens (Azure LLM inference trace; one tenant) |
| vtc_lmsys | req_time_s, tenant, prompt_len, output_len (the VTC artifact's LMSYS trace) |
| plain | arrival_s, [tenant,] prompt_tokens, output_tokens (CSV, or JSON lines) |

Without a tenant column every request belongs to the tenant "default". Arrivals are seconds
from the first request; rows are sorted by arrival. Counts below 1 are raised to 1 (vLLM needs
a prompt token and an output token).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

SINGLE_TENANT = "default"


class TraceError(ValueError):
    """A trace that cannot be read; the message names the file."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    tenant: str
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class Trace:
    format: str
    requests: list[TraceRequest]

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    @property
    def tenants(self) -> list[str]:
        return sorted({r.tenant for r in self.requests})

    def scaled(self, rate_scale: float) -> Trace:
        """Arrivals compressed by `rate_scale` (2: twice the request rate)."""
        if rate_scale <= 0:
            raise ValueError("rate scale must be positive")
        return Trace(
            self.format,
            [replace(r, arrival_s=r.arrival_s / rate_scale) for r in self.requests],
        )


Row = Mapping[str, Any]
_FORMATS: dict[str, tuple[frozenset[str], Callable[[Row], tuple[Any, str, Any, Any]]]] = {
    "azure2023": (
        frozenset({"TIMESTAMP", "ContextTokens", "GeneratedTokens"}),
        lambda r: (r["TIMESTAMP"], SINGLE_TENANT, r["ContextTokens"], r["GeneratedTokens"]),
    ),
    "vtc_lmsys": (
        frozenset({"req_time_s", "tenant", "prompt_len", "output_len"}),
        lambda r: (r["req_time_s"], r["tenant"], r["prompt_len"], r["output_len"]),
    ),
    "plain": (
        frozenset({"arrival_s", "prompt_tokens", "output_tokens"}),
        lambda r: (
            r["arrival_s"],
            str(r.get("tenant") or SINGLE_TENANT),
            r["prompt_tokens"],
            r["output_tokens"],
        ),
    ),
}


def detect(columns: Iterable[str]) -> str:
    """The format whose required columns are all present."""
    present = {c.strip() for c in columns}
    for name, (required, _) in _FORMATS.items():
        if required <= present:
            return name
    expected = "; ".join(", ".join(sorted(req)) for req, _ in _FORMATS.values())
    raise ValueError(f"unknown columns {sorted(present)}; expected one of: {expected}")


def _rows(text: str) -> tuple[list[str], Iterator[Row], int]:
    """The columns, the rows, and the line number of the first row."""
    if text.lstrip().startswith("{"):
        records = []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError(f"line {number}: not a JSON object")
                records.append(record)
        return list(records[0]), iter(records), 1
    reader = csv.DictReader(io.StringIO(text))
    return list(reader.fieldnames or []), iter(reader), 2


def _seconds(value: Any, first: list[datetime]) -> float:
    if isinstance(value, int | float):
        return float(value)
    text = str(value).strip()
    try:
        return float(text)
    except ValueError:
        stamp = datetime.fromisoformat(text)
    if not first:
        first.append(stamp)
    return (stamp - first[0]).total_seconds()


def parse(text: str, source: str, *, limit: int | None = None) -> Trace:
    """Read trace `text` (`source` names it in errors); keep the first `limit` rows."""
    try:
        columns, rows, first_line = _rows(text)
        name = detect(columns)
        extract = _FORMATS[name][1]
        requests: list[TraceRequest] = []
        first: list[datetime] = []
        for line, row in enumerate(rows, start=first_line):
            if limit is not None and len(requests) >= limit:
                break
            try:
                arrival, tenant, prompt, output = extract(row)
                requests.append(
                    TraceRequest(
                        _seconds(arrival, first),
                        str(tenant),
                        max(1, int(prompt)),
                        max(1, int(output)),
                    )
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"row {line}: {exc}") from None
    except ValueError as exc:
        raise TraceError(f"{source}: {exc}") from None
    if not requests:
        raise TraceError(f"{source}: no requests")
    requests.sort(key=lambda r: r.arrival_s)
    start = requests[0].arrival_s
    return Trace(name, [replace(r, arrival_s=r.arrival_s - start) for r in requests])


def load(path: str | Path, *, limit: int | None = None) -> Trace:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror}") from None
    return parse(text, str(path), limit=limit)
