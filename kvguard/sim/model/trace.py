"""Request traces: token counts and arrival times, read from CSV or JSON lines.

The format is told by the header (the keys of the first JSON line):

| format | columns |
|---|---|
| azure2023 | TIMESTAMP, ContextTokens, GeneratedTokens (Azure LLM inference trace; one tenant) |
| vtc_lmsys | req_time_s, tenant, prompt_len, output_len (the VTC artifact's LMSYS trace) |
| plain | arrival_s, [tenant,] prompt_tokens, output_tokens (CSV, or JSON lines) |

Any format may add a `max_tokens` column: the output limit the client sent (a whole number, at
least 1). Where it is absent or empty the client sent none, and kvguard injects the tier's
default. The output tokens are what the answer really produces: it stops there, or at the limit.
Without a tenant column every request belongs to the tenant "default". Arrivals are seconds
from the first request (numbers, or ISO dates and times: all with a timezone or all without);
rows must come in order of arrival. Token counts are whole numbers, not
negative; 0 is raised to 1 (vLLM needs a prompt token and an output token). Errors name the
file and the line (from 1, a CSV header being line 1).
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

SINGLE_TENANT = "default"
MAX_TOKENS = "max_tokens"  # the optional column of the client's output limit, in every format


class TraceError(ValueError):
    """A trace that cannot be read; the message names the file."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    tenant: str
    prompt_tokens: int
    output_tokens: int  # what the answer produces when nothing cuts it short
    max_tokens: int | None = None  # the limit the client sent; None: it sent none


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


@dataclass(frozen=True, slots=True)
class _Format:
    """A format's columns. `tenant` None: one tenant; a tenant column that is not required may
    be absent or empty (one tenant too)."""

    arrival: str
    prompt: str
    output: str
    tenant: str | None
    tenant_required: bool = False

    @property
    def required(self) -> frozenset[str]:
        columns = {self.arrival, self.prompt, self.output}
        if self.tenant is not None and self.tenant_required:
            columns.add(self.tenant)
        return frozenset(columns)


_FORMATS = {
    "azure2023": _Format("TIMESTAMP", "ContextTokens", "GeneratedTokens", None),
    "vtc_lmsys": _Format("req_time_s", "prompt_len", "output_len", "tenant", tenant_required=True),
    "plain": _Format("arrival_s", "prompt_tokens", "output_tokens", "tenant"),
}


def detect(columns: Iterable[str]) -> str:
    """The format whose required columns are all present."""
    present = {c.strip() for c in columns}
    for name, columns_of in _FORMATS.items():
        if columns_of.required <= present:
            return name
    expected = "; ".join(", ".join(sorted(f.required)) for f in _FORMATS.values())
    raise ValueError(f"unknown columns {sorted(present)}; expected one of: {expected}")


def _rows(text: str) -> tuple[list[str], Iterator[tuple[int, Row]]]:
    """The columns, and each row with its line in the file (from 1; a CSV header is line 1)."""
    if text.lstrip().startswith("{"):
        records: list[tuple[int, Row]] = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                problem = f"not JSON ({exc.msg}, column {exc.colno})"
                raise ValueError(f"line {number}: {problem}") from None
            if not isinstance(record, dict):
                raise ValueError(f"line {number}: not a JSON object")
            records.append((number, {str(key).strip(): v for key, v in record.items()}))
        return list(records[0][1]), iter(records)
    reader = csv.DictReader(io.StringIO(text))
    if reader.fieldnames:
        reader.fieldnames = [name.strip() for name in reader.fieldnames]
    # line_num: the line a row ends on (blank lines, which DictReader skips, count too).
    return list(reader.fieldnames or []), ((reader.line_num, row) for row in reader)


def _number(column: str, value: Any) -> tuple[float, str]:
    """The value as a float (nan when it is not a number), and how to show it."""
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ValueError(f"{column} is missing")
    if isinstance(value, bool):
        return math.nan, json.dumps(value)
    try:
        number = float(value)
    except (TypeError, ValueError):
        return math.nan, repr(value)
    return number, value.strip() if isinstance(value, str) else str(value)


def _seconds(column: str, value: Any, first: list[tuple[datetime, str]]) -> float:
    """Seconds: a number, or an ISO date and time (seconds from the first one, kept in `first`
    with how it was written)."""
    seconds, shown = _number(column, value)
    if math.isfinite(seconds):
        return seconds
    written = str(value).strip()
    try:
        stamp = datetime.fromisoformat(written)
    except ValueError:
        raise ValueError(f"{column} is {shown}: expected seconds or an ISO date and time") from None
    if not first:
        first.append((stamp, written))
    start, start_written = first[0]
    if (stamp.utcoffset() is None) != (start.utcoffset() is None):
        # Python cannot subtract the two, and nothing says how far apart they are.
        this, that = ("no timezone", "one") if stamp.utcoffset() is None else ("a timezone", "none")
        raise ValueError(
            f"{column} {written} has {this} and the first row's {start_written} has {that}: "
            "give every time a timezone, or none"
        )
    return (stamp - start).total_seconds()


def _tokens(column: str, value: Any) -> int:
    """A token count: a whole number, not negative; 0 is raised to 1 (vLLM needs one)."""
    count, shown = _number(column, value)
    if not count.is_integer():  # nan and inf are not either
        raise ValueError(f"{column} is {shown}: token counts are whole numbers")
    if count < 0:
        raise ValueError(f"{column} is {shown}: token counts cannot be negative")
    return max(1, int(count))


def _limit(value: Any) -> int | None:
    """The client's output limit: None when absent or empty, else a whole number, at least 1."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    count, shown = _number(MAX_TOKENS, value)
    if not count.is_integer():
        raise ValueError(f"{MAX_TOKENS} is {shown}: token counts are whole numbers")
    if count < 1:
        raise ValueError(f"{MAX_TOKENS} is {shown}: a limit is at least 1 token")
    return int(count)


def parse(text: str, source: str, *, limit: int | None = None) -> Trace:
    """Read trace `text` (`source` names it in errors); keep the first `limit` rows.

    Rows must come in order of arrival (equal arrivals are fine)."""
    try:
        columns, rows = _rows(text)
        name = detect(columns)
        columns_of = _FORMATS[name]
        requests: list[TraceRequest] = []
        first: list[tuple[datetime, str]] = []
        previous = ""  # the previous row's arrival, as written
        for line, row in rows:
            if limit is not None and len(requests) >= limit:
                break
            try:
                value = row.get(columns_of.arrival)
                arrival = _seconds(columns_of.arrival, value, first)
                written = str(value).strip()
                if requests and arrival < requests[-1].arrival_s:
                    raise ValueError(
                        f"{columns_of.arrival} {written} is before the previous row's "
                        f"{previous}: rows must be in order of arrival"
                    )
                previous = written
                tenant = row.get(columns_of.tenant) if columns_of.tenant else None
                if columns_of.tenant_required and tenant in (None, ""):
                    raise ValueError(f"{columns_of.tenant} is missing")
                requests.append(
                    TraceRequest(
                        arrival,
                        str(tenant or SINGLE_TENANT),
                        _tokens(columns_of.prompt, row.get(columns_of.prompt)),
                        _tokens(columns_of.output, row.get(columns_of.output)),
                        _limit(row.get(MAX_TOKENS)),
                    )
                )
            except ValueError as exc:
                raise ValueError(f"line {line}: {exc}") from None
    except ValueError as exc:
        raise TraceError(f"{source}: {exc}") from None
    if not requests:
        raise TraceError(f"{source}: no requests")
    start = requests[0].arrival_s
    return Trace(name, [replace(r, arrival_s=r.arrival_s - start) for r in requests])


def load(path: str | Path, *, limit: int | None = None) -> Trace:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror}") from None
    return parse(text, str(path), limit=limit)
