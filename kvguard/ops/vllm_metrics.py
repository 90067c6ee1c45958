"""vLLM's /metrics text, parsed into what kvguard reads: an endpoint's cache configuration, its
output-length histogram, its KV-cache usage and its engine counters (`EndpointReading`).

vLLM publishes its cache configuration as the labels of one gauge sample,
``vllm:cache_config_info{block_size="128",num_gpu_blocks="64",...} 1.0`` (vLLM keeps one block
back: its null block; nothing assumes a block size of 16: the CPU backend uses 128).

vLLM's /metrics holds some 90 families; only the lines of those read here reach the parser
(`relevant`), which keeps a refresh on the event loop short.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvguard.admission.outputs import Histogram

CACHE_CONFIG_INFO = "vllm:cache_config_info"
GENERATION_TOKENS = "vllm:request_generation_tokens"  # histogram: output tokens per request
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"  # gauge: the share of blocks in use, 0 to 1
NUM_PREEMPTIONS = "vllm:num_preemptions"  # counter (vllm:num_preemptions_total)
REQUESTS_WAITING = "vllm:num_requests_waiting"  # gauge: requests in vLLM's queue
INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"  # histogram: seconds between tokens
TIME_PER_OUTPUT_TOKEN = "vllm:time_per_output_token_seconds"  # its name on an older vLLM
# The families read, with the sample names each needs (name + suffix): only these lines of a
# /metrics text are parsed.
READ_FAMILIES: dict[str, tuple[str, ...]] = {
    CACHE_CONFIG_INFO: ("",),
    GENERATION_TOKENS: ("_bucket", "_count", "_sum"),
    KV_CACHE_USAGE: ("",),
    NUM_PREEMPTIONS: ("_total", ""),
    REQUESTS_WAITING: ("",),
    INTER_TOKEN_LATENCY: ("_count", "_sum"),
    TIME_PER_OUTPUT_TOKEN: ("_count", "_sum"),
}


class DiscoveryError(Exception):
    """An endpoint's /metrics (or a pool's endpoints together) cannot give a capacity."""


@dataclass(frozen=True, slots=True)
class EndpointCache:
    """What one endpoint reports: usable blocks (null blocks taken off) and the block size."""

    usable_blocks: int
    block_size: int


@dataclass(frozen=True, slots=True)
class TokenIntervals:
    """The intervals between a sequence's consecutive tokens that vLLM observed: how many, and
    their seconds summed (its inter-token latency histogram's _count and _sum)."""

    count: float
    seconds: float

    def since(self, earlier: TokenIntervals | None) -> TokenIntervals:
        """The intervals observed after `earlier` was read; all of them when either counter
        went down (the server restarted)."""
        if earlier is None or self.count < earlier.count or self.seconds < earlier.seconds:
            return self
        return TokenIntervals(self.count - earlier.count, self.seconds - earlier.seconds)


@dataclass(frozen=True, slots=True)
class EndpointReading:
    """One endpoint's /metrics as discovery reads it: the cache, and what its requests produced
    since the server started (None where this vLLM does not export it)."""

    cache: EndpointCache
    generated: Histogram | None = None
    used_blocks: int | None = None  # blocks vLLM holds now, from its KV-cache usage
    preemptions: int | None = None  # preemptions since the server started
    waiting: int | None = None  # requests waiting in its queue now
    intervals: TokenIntervals | None = None  # between consecutive tokens, since it started


def parse_cache_config(text: str) -> EndpointCache:
    """The cache configuration in Prometheus exposition `text` from a vLLM /metrics.

    One sample per engine (a data-parallel server has several, each with its own cache and its
    own null block); their usable blocks add up. Raises DiscoveryError when the gauge is missing
    or its labels are not usable.
    """
    return parse_metrics(text).cache


def parse_metrics(text: str) -> EndpointReading:
    """Everything discovery reads in a vLLM /metrics text (the lines of READ_FAMILIES only);
    DiscoveryError as parse_cache_config."""
    return reading(text_string_to_metric_families(relevant(text)))


_PREFIXES = tuple(
    start
    for family, suffixes in READ_FAMILIES.items()
    for name in {family, *(family + suffix for suffix in suffixes)}
    for start in (f"{name}{{", f"{name} ", f"# HELP {name} ", f"# TYPE {name} ")
)


def relevant(text: str) -> str:
    """The lines of a Prometheus text that belong to READ_FAMILIES: their # HELP and # TYPE
    lines and their samples. Lines of other families are not parsed, so they cannot make a
    text fail to parse either.

    Each family's name is searched for in the whole text (a scan in C), and only the lines it
    occurs in are looked at: the cost follows those few lines, not the text's thousands."""
    starts: set[int] = set()
    for family in READ_FAMILIES:
        at = text.find(family)
        while at >= 0:
            start = text.rfind("\n", 0, at) + 1
            if start not in starts and text.startswith(_PREFIXES, start):
                starts.add(start)
            at = text.find(family, at + len(family))
    lines = []
    for start in sorted(starts):  # in the text's order: a family's samples follow its # TYPE
        end = text.find("\n", start)
        lines.append(text[start:] + "\n" if end < 0 else text[start : end + 1])
    return "".join(lines)


def reading(families: Iterable[Metric]) -> EndpointReading:
    """The cache configuration, the output-length histogram, the KV-cache usage and the
    engine's counters in one pass over parsed metric families."""
    samples: list[Sample] = []
    generated: list[Sample] = []
    latencies: dict[str, list[Sample]] = {INTER_TOKEN_LATENCY: [], TIME_PER_OUTPUT_TOKEN: []}
    usage: list[float] = []
    preemptions: list[float] = []
    waiting: list[float] = []
    counter = (NUM_PREEMPTIONS + "_total", NUM_PREEMPTIONS)
    try:
        for family in families:
            if family.name == CACHE_CONFIG_INFO:
                samples.extend(s for s in family.samples if s.name == CACHE_CONFIG_INFO)
            elif family.name == GENERATION_TOKENS:
                generated.extend(family.samples)
            elif family.name == KV_CACHE_USAGE:
                usage.extend(s.value for s in family.samples)
            elif family.name == NUM_PREEMPTIONS:
                preemptions.extend(s.value for s in family.samples if s.name in counter)
            elif family.name == REQUESTS_WAITING:
                waiting.extend(s.value for s in family.samples if s.name == REQUESTS_WAITING)
            elif family.name in latencies:
                latencies[family.name].extend(family.samples)
    except ValueError as exc:
        raise DiscoveryError(f"the /metrics text does not parse: {exc}") from None
    cache = _cache(samples)
    used = None
    if usage:  # engines of one server have equal caches: their mean share of the whole
        used = round(min(max(sum(usage) / len(usage), 0.0), 1.0) * cache.usable_blocks)
    intervals = _intervals(latencies[INTER_TOKEN_LATENCY], INTER_TOKEN_LATENCY)
    if intervals is None:
        intervals = _intervals(latencies[TIME_PER_OUTPUT_TOKEN], TIME_PER_OUTPUT_TOKEN)
    return EndpointReading(
        cache,
        histogram(generated, GENERATION_TOKENS),
        used,
        round(sum(preemptions)) if preemptions else None,
        round(sum(waiting)) if waiting else None,
        intervals,
    )


def histogram(samples: Iterable[Sample], name: str) -> Histogram | None:
    """The samples of histogram `name` summed over their other labels (engines, models);
    None when there are none."""
    buckets: dict[float, float] = {}
    count = total = 0.0
    seen = False
    for sample in samples:
        if sample.name == name + "_bucket":
            bound = float(sample.labels.get("le", "nan"))
            if not math.isnan(bound):
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
            seen = True
        elif sample.name == name + "_count":
            count += sample.value
        elif sample.name == name + "_sum":
            total += sample.value
    if not seen:
        return None
    bounds = tuple(sorted(b for b in buckets if not math.isinf(b)))
    return Histogram(bounds, tuple(buckets[b] for b in bounds), count, total)


def _intervals(samples: Iterable[Sample], name: str) -> TokenIntervals | None:
    """The _count and _sum of histogram `name`, summed over engines and models; None when it
    has no _count."""
    count = seconds = 0.0
    seen = False
    for sample in samples:
        if sample.name == name + "_count":
            count, seen = count + sample.value, True
        elif sample.name == name + "_sum":
            seconds += sample.value
    return TokenIntervals(count, seconds) if seen else None


def _cache(samples: list[Sample]) -> EndpointCache:
    if not samples:
        raise DiscoveryError(f"no {CACHE_CONFIG_INFO} in /metrics (is this a vLLM server?)")
    usable = 0
    block_sizes: set[int] = set()
    for sample in samples:
        blocks = _label_int(sample.labels, "num_gpu_blocks")
        if blocks < 2:
            raise DiscoveryError(f"{CACHE_CONFIG_INFO}: num_gpu_blocks={blocks} leaves no block")
        usable += blocks - 1
        block_sizes.add(_label_int(sample.labels, "block_size"))
    if len(block_sizes) != 1:
        raise DiscoveryError(f"{CACHE_CONFIG_INFO}: engines disagree on block_size {block_sizes}")
    return EndpointCache(usable, block_sizes.pop())


def _label_int(labels: Mapping[str, str], name: str) -> int:
    value = labels.get(name)
    if value is None:
        raise DiscoveryError(f"{CACHE_CONFIG_INFO} has no {name} label")
    try:
        number = int(value)
    except ValueError:
        raise DiscoveryError(f"{CACHE_CONFIG_INFO}: {name}={value!r} is not an integer") from None
    if number <= 0:
        raise DiscoveryError(f"{CACHE_CONFIG_INFO}: {name}={number} must be positive")
    return number
