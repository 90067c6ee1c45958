"""One Prometheus exposition for a pod of server.workers processes, merged from theirs.

The supervisor reads its live workers together (`PodMetrics.read_round`). Each family merges by
its rule in kvguard.ops.metrics.MERGE_RULES (a family missing there: SUM for a counter,
histogram or summary, MAX otherwise):

- SUM families are added up sample by sample (every bucket, `_count` and `_sum` of a
  histogram), from every live worker's last reading and from the last reading of every worker
  that died: a restarted worker counts from zero, and the pod's totals never go down.
- A SHARED_COUNTER family (the same events, counted by every worker from its own start) moves
  by one worker's increase per read: the leader, the longest-read live worker that answered
  this read and the one before, adds what it counted in between; when no worker did, the pod's
  value stays. It starts at the first leader's value and never goes down, whoever dies.
- The other rules read only the workers that answered this time.

A reading in which a counting sample (a counter, a histogram's buckets, `_count` or `_sum`) is
below the same worker's last reading is a bad one: like no answer, it leaves the last good
reading standing. Within one process's life these samples only grow (kvguard's histograms
record no negative value).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from kvguard.ops.metrics import MERGE_RULES, Merge

# A sample's identity across workers: its name (a histogram's `_bucket`, `_sum`...) and labels.
SampleKey = tuple[str, tuple[tuple[str, str], ...]]
_COUNTING_TYPES = ("counter", "histogram", "summary", "gaugehistogram")
# The samples that only grow over a process's life, by their family's type.
_GROWING_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_count", "_sum"),
    "summary": ("_count", "_sum"),
}
_COMBINE: dict[Merge, Callable[[float, float], float]] = {
    Merge.SUM: lambda a, b: a + b,
    Merge.SUM_LIVE: lambda a, b: a + b,
    Merge.MAX: max,
    Merge.MIN: min,
    Merge.FIRST: lambda a, _: a,
    Merge.SHARED_COUNTER: lambda a, b: a + b,  # the pod's value plus the leader's increase
}


def exposed_name(family: Metric) -> str:
    """The family's name as the exposition and MERGE_RULES spell it (counters end in _total)."""
    return f"{family.name}_total" if family.type == "counter" else family.name


def rule_of(family: Metric, rules: dict[str, Merge] = MERGE_RULES) -> Merge:
    default = Merge.SUM if family.type in _COUNTING_TYPES else Merge.MAX
    return rules.get(exposed_name(family), default)


def parse(text: str) -> list[Metric]:
    """A worker's exposition (text format 0.0.4) as metric families; ValueError if malformed."""
    return list(text_string_to_metric_families(text))


@dataclass
class _Reading:
    families: list[Metric]
    read_in: int  # the number of the read it came from (PodMetrics.read_round)
    fresh: bool = True  # read on the last attempt (False: the worker did not answer then)


@dataclass
class _Family:
    """One family as it is being merged: its metadata and its samples' values so far."""

    template: Metric
    rule: Merge
    values: dict[SampleKey, float] = field(default_factory=dict)

    def add(self, key: SampleKey, value: float) -> None:
        before = self.values.get(key)
        self.values[key] = value if before is None else _COMBINE[self.rule](before, value)

    def metric(self) -> Metric:
        out = Metric(self.template.name, self.template.documentation, self.template.type)
        for (name, labels), value in self.values.items():
            out.add_sample(name, dict(labels), value)
        return out


def _key(name: str, labels: dict[str, str]) -> SampleKey:
    return name, tuple(sorted(labels.items()))


def _growing(families: list[Metric]) -> dict[SampleKey, float]:
    """The reading's samples that only grow over its process's life."""
    return {
        _key(sample.name, sample.labels): sample.value
        for family in families
        for sample in family.samples
        if sample.name.endswith(_GROWING_SUFFIXES.get(family.type, ()))
    }


def _went_down(last: list[Metric], now: list[Metric]) -> bool:
    """Whether a sample that only grows is below its value in the same worker's last reading."""
    before = _growing(last)
    return any(value < before.get(key, value) for key, value in _growing(now).items())


class PodMetrics:
    """The supervisor's record of its workers' expositions, and their merge."""

    def __init__(self, rules: dict[str, Merge] = MERGE_RULES) -> None:
        self._rules = rules
        # Live worker index -> its last good reading, the longest-read worker first (a dict
        # keeps the order of first insertion; `died` removes a worker, its restart comes last).
        self._last: dict[int, _Reading] = {}
        self._retired: dict[str, _Family] = {}  # SUM families of the workers that died
        self._shared: dict[str, _Family] | None = None  # SHARED_COUNTER; None: no leader yet
        self._reads = 0
        self.restarts = 0  # workers the supervisor started again

    def read_round(self, answers: Mapping[int, str | None]) -> None:
        """Record one read of the live workers: worker -> its exposition, None (or a text that
        is malformed or counts less than the worker's last reading) where it did not answer:
        its last counts still stand, and nothing else of it shows."""
        self._reads += 1
        before = dict(self._last)
        for worker in sorted(answers):
            self._record(worker, answers[worker])
        self._advance_shared(before)

    def _record(self, worker: int, text: str | None) -> None:
        try:
            families = parse(text) if text is not None else None
        except ValueError:
            families = None
        last = self._last.get(worker)
        if families is not None and (last is None or not _went_down(last.families, families)):
            self._last[worker] = _Reading(families, self._reads)
        elif last is not None:
            last.fresh = False

    def _advance_shared(self, before: dict[int, _Reading]) -> None:
        """Move the SHARED_COUNTER families by the leader's increase since the last read."""
        answered = [w for w, reading in self._last.items() if reading.read_in == self._reads]
        if self._shared is None:
            if answered:  # the first leader: its values are where the pod's start
                self._shared = {}
                self._add_increase(self._shared, self._last[answered[0]].families, [])
            return
        for worker in answered:
            previous = before.get(worker)
            if previous is not None and previous.read_in == self._reads - 1:
                self._add_increase(self._shared, self._last[worker].families, previous.families)
                return

    def _add_increase(
        self, shared: dict[str, _Family], now: list[Metric], previous: list[Metric]
    ) -> None:
        """Add to `shared` what each SHARED_COUNTER sample grew by from `previous` to `now`."""
        was = {
            _key(sample.name, sample.labels): sample.value
            for family in previous
            for sample in family.samples
        }
        for family in now:
            if rule_of(family, self._rules) is not Merge.SHARED_COUNTER:
                continue
            into = shared.setdefault(family.name, _Family(family, Merge.SHARED_COUNTER))
            for sample in family.samples:
                key = _key(sample.name, sample.labels)
                into.add(key, max(0.0, sample.value - was.get(key, 0.0)))

    def died(self, worker: int) -> None:
        """`worker` exited: its last counts stay in the pod's totals."""
        reading = self._last.pop(worker, None)
        for family in reading.families if reading else []:
            if rule_of(family, self._rules) is not Merge.SUM:
                continue
            into = self._retired.setdefault(family.name, _Family(family, Merge.SUM))
            for sample in family.samples:
                into.add(_key(sample.name, sample.labels), sample.value)

    def collect(self) -> list[Metric]:
        """The pod's exposition: every family merged by its rule, then the supervisor's own."""
        merged: dict[str, _Family] = {}
        for worker in sorted(self._last):
            reading = self._last[worker]
            for family in reading.families:
                self._merge_into(merged, family, reading.fresh)
        for name, retired in self._retired.items():
            into = merged.setdefault(name, _Family(retired.template, Merge.SUM))
            for key, value in retired.values.items():
                into.add(key, value)
        merged.update(self._shared or {})
        restarts = CounterMetricFamily(
            "kvguard_worker_restarts", "Workers the supervisor started again", self.restarts
        )
        return [family.metric() for family in merged.values()] + [restarts]

    def _merge_into(self, merged: dict[str, _Family], family: Metric, fresh: bool) -> None:
        rule = rule_of(family, self._rules)
        if rule is Merge.SHARED_COUNTER:
            return  # the pod's own value (_advance_shared)
        if rule is not Merge.SUM and not fresh:
            return  # a view, not a count: only what was read now
        if rule is Merge.FIRST and family.name in merged:
            return  # another worker's series stand for this one's
        into = merged.setdefault(family.name, _Family(family, rule))
        for sample in family.samples:
            into.add(_key(sample.name, sample.labels), sample.value)
