"""An endpoint's readings over time: what each adds to the last, the deltas of vLLM's counters.

A counter that went down is a restarted server, whose counts start again. An endpoint's first
reading is the baseline and counts no preemption: what happened before kvguard watched says
nothing of its reservations; its histograms and token intervals count all the server observed
since it started.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvguard.admission.outputs import Histogram
from kvguard.ops.vllm_metrics import EndpointReading, TokenIntervals


@dataclass
class Endpoint:
    reading: EndpointReading | None = None
    read_at: float = 0.0
    # The histogram as last read, for the next delta; kept while the endpoint fails, so that
    # a recovered server's counts are not learnt twice.
    generated: Histogram | None = None
    preemptions: int | None = None
    intervals: TokenIntervals | None = None
    error: str | None = None  # the last failure, while failing


@dataclass(frozen=True, slots=True)
class Learnt:
    """What one endpoint's reading adds to the last: the deltas of its counters."""

    generated: Histogram | None
    preemptions: int | None  # None where it exports no preemption counter
    intervals: TokenIntervals | None


def learn(endpoint: Endpoint, reading: EndpointReading) -> Learnt:
    """The endpoint's counters since its last reading, and remembers this reading for the next.
    At the first, the histogram and intervals count all the server observed since it started,
    the preemptions none (the baseline); after a restart (a counter went down), its new value.
    """
    generated = reading.generated.since(endpoint.generated) if reading.generated else None
    intervals = reading.intervals.since(endpoint.intervals) if reading.intervals else None
    preemptions = None
    if reading.preemptions is not None:
        last = endpoint.preemptions
        if last is None:
            preemptions = 0
        elif reading.preemptions < last:
            preemptions = reading.preemptions
        else:
            preemptions = reading.preemptions - last
    endpoint.generated = reading.generated
    endpoint.preemptions, endpoint.intervals = reading.preemptions, reading.intervals
    return Learnt(generated, preemptions, intervals)


def total(histograms: Iterable[Histogram | None]) -> Histogram | None:
    """The sum of the histograms given; those whose bounds differ from the first are left out
    (endpoints of different vLLM versions)."""
    out: Histogram | None = None
    for histogram in histograms:
        if histogram is None:
            continue
        if out is None:
            out = histogram
        elif histogram.bounds == out.bounds:
            out = out.plus(histogram)
    return out
