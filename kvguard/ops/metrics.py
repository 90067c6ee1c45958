"""Every kvguard instrument, created here and fed through named functions.

Handlers never touch OpenTelemetry types. The MeterProvider is an argument, so tests read exact
values with the SDK's in-memory reader. Prometheus names (a contract: dashboards use them):

    kvguard_admissions_total{pool,tier,outcome,reason}   one per guarded request, where
        outcome: admitted | refused | shadow_refused | cancelled (OUTCOMES)
        reason: the refusal code; "" when admitted or cancelled
    kvguard_tenant_refusals_total{pool,tenant,outcome,reason}  one per refused request, where
        outcome: refused | shadow_refused; tenant: a tenant the configuration names, any
        other as "other" (Tenancy.metered_tenant), "" when none was known
    kvguard_decision_duration_seconds                    histogram, one per guarded request
    kvguard_prompt_tokens                                histogram, admitted requests
    kvguard_completion_tokens{pool,tier}                 histogram, released leases whose
        completion tokens kvguard read (non-streamed usage, sampled streams)
    kvguard_reserved_blocks{pool}                        the ledger's shared view
    kvguard_capacity_blocks{pool}                        usable blocks (static or discovered)
    kvguard_engine_used_blocks{pool}                     blocks vLLM reports in use (discovered)
    kvguard_engine_preemptions_total{pool}               preemptions vLLM counted (discovered)
    kvguard_engine_waiting_requests{pool}                requests in vLLM's queue (discovered)
    kvguard_reservation_trust{pool}                      1: calibrated reservations reserve their
        estimate; 0: the worst case (discovered)
    kvguard_tenant_reserved_blocks{pool,tenant}          top tenants, the rest as tenant="other"
    kvguard_pod_reserved_blocks{pool,pod}                each pod's (routing: pick)
    kvguard_capacity_age_seconds{pool}                   age of the last capacity discovery
    kvguard_ledger_errors_total                          ledger calls that failed
    kvguard_config_reloads_total{result}                 result: applied|rejected; both series
        exist from the start, at 0
    kvguard_drain_cut_streams_total                      streams still open at drain_seconds, cut
    kvguard_queued_requests{pool}                        requests waiting in this process's queue
    kvguard_queue_wait_seconds{pool,outcome}             histogram, one per request that queued,
        outcome: admitted | timed_out | full | left | failed (admission.queue)
    kvguard_promised_blocks{pool}                        blocks promised to 429s' retries (the
        ledger's shared view)
    kvguard_ledger_available                             1 while the ledger is reachable (always
        on memory://), 0 while not
    kvguard_capacity_known{pool}                         1 when the pool's capacity is known
        (static or discovered), 0 when not; every pool of the policy has a series
    kvguard_ledger_replicas                              the kvguard processes on_unavailable:
        local divides the pool by; no series while unknown
    kvguard_worker_restarts_total                        workers the supervisor started again
        (server.workers > 1 only: the supervisor's own, kvguard.ops.metrics_merge)

With server.workers > 1 the supervisor serves one exposition for the pod, merging its workers'
by MERGE_RULES: each instrument's rule is declared there, beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation

from kvguard.admission.record import RequestOutcome
from kvguard.config.schema import OTHER_TENANTS

# Seconds: from the short decisions of small prompts, past the long counts of 32k-token ones,
# to the 200 ms after which Envoy gives up on an answer.
DECISION_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
PROMPT_BUCKETS = (16, 64, 256, 1024, 4096, 8192, 16384, 32768, 65536, 131072)
# vLLM's own bounds for vllm:request_generation_tokens, then the longer limits tiers allow.
COMPLETION_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 4096, 8192, 16384, 32768)
# Seconds a request waits in a pool's queue: up to the longest wait the configuration allows.
QUEUE_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0)
# kvguard_admissions_total's outcome label, admission.record.Decision.outcome: admitted; refused
# (kvguard answered with an error); shadow_refused (shadow mode: it would refuse, and let the
# request through); cancelled (the stream ended before the answer went out).
OUTCOMES = tuple(RequestOutcome)
# kvguard_tenant_refusals_total's outcomes
REFUSED_OUTCOMES = (RequestOutcome.REFUSED, RequestOutcome.SHADOW_REFUSED)


class Merge(Enum):
    """How the supervisor of server.workers > 1 merges one family over its workers."""

    SUM = "sum"  # counted by each worker: added up, a dead worker's last values kept
    SUM_LIVE = "sum_live"  # held by each live worker (its own queue): added up over them
    MAX = "max"  # the same shared view in every worker (ledger, vLLM): the highest value
    MIN = "min"  # a condition every worker must see (ledger reachable): the lowest value
    FIRST = "first"  # one worker's series stand for all (the lowest-numbered that answered)
    # A counter of the same events in every worker, each from its own start: the pod's value
    # moves by one worker's increase per read, and never goes down.
    SHARED_COUNTER = "shared_counter"


# Each Prometheus family's rule, by its exposed name. A family missing here merges as SUM when
# it is a counter, histogram or summary and as MAX otherwise (kvguard.ops.metrics_merge).
MERGE_RULES: dict[str, Merge] = {
    "kvguard_admissions_total": Merge.SUM,
    "kvguard_tenant_refusals_total": Merge.SUM,
    "kvguard_decision_duration_seconds": Merge.SUM,
    "kvguard_prompt_tokens": Merge.SUM,
    "kvguard_completion_tokens": Merge.SUM,
    "kvguard_ledger_errors_total": Merge.SUM,
    "kvguard_config_reloads_total": Merge.SUM,
    "kvguard_drain_cut_streams_total": Merge.SUM,
    "kvguard_queue_wait_seconds": Merge.SUM,
    "kvguard_reserved_blocks": Merge.MAX,
    "kvguard_capacity_blocks": Merge.MAX,
    "kvguard_engine_used_blocks": Merge.MAX,
    "kvguard_engine_preemptions_total": Merge.SHARED_COUNTER,  # the same vLLM events
    "kvguard_engine_waiting_requests": Merge.MAX,
    "kvguard_reservation_trust": Merge.MAX,
    "kvguard_capacity_age_seconds": Merge.MAX,
    "kvguard_queued_requests": Merge.SUM_LIVE,
    "kvguard_promised_blocks": Merge.MAX,
    "kvguard_tenant_reserved_blocks": Merge.MAX,
    "kvguard_pod_reserved_blocks": Merge.MAX,
    "kvguard_ledger_available": Merge.MIN,
    "kvguard_capacity_known": Merge.MIN,
    "kvguard_ledger_replicas": Merge.MAX,
    # The workers' resource: the same service name and version, each its own instance id.
    "target_info": Merge.FIRST,
}


@dataclass
class LedgerView:
    """The last values read from the ledger and discovery; the gauges report these."""

    reserved: dict[str, int] = field(default_factory=dict)  # pool -> blocks
    tenants: dict[str, dict[str, int]] = field(default_factory=dict)  # pool -> tenant -> blocks
    # pool -> pod -> blocks, for the pods discovered now (the label's values are bounded by them)
    pods: dict[str, dict[str, int]] = field(default_factory=dict)
    capacity: dict[str, int] = field(default_factory=dict)  # pool -> blocks
    used: dict[str, int] = field(default_factory=dict)  # pool -> blocks vLLM holds
    preemptions: dict[str, int] = field(default_factory=dict)  # pool -> since kvguard started
    waiting: dict[str, int] = field(default_factory=dict)  # pool -> requests in vLLM's queue
    trust: dict[str, float] = field(default_factory=dict)  # pool -> 0 (worst case) to 1
    promised: dict[str, int] = field(default_factory=dict)  # pool -> blocks promised to retries
    queued: dict[str, int] = field(default_factory=dict)  # pool -> requests waiting here
    capacity_age_s: dict[str, float] = field(default_factory=dict)  # pool -> seconds
    capacity_known: dict[str, int] = field(default_factory=dict)  # pool -> 1 known, 0 not
    # The health's "ledger", 1 or 0 (OTLP takes no booleans); None before the first read.
    ledger_available: int | None = None
    replicas: int | None = None  # what on_unavailable: local divides by; None while unknown


class Metrics:
    def __init__(self, provider: MeterProvider, *, top_tenants: int = 20) -> None:
        meter = provider.get_meter("kvguard")
        self.view = LedgerView()
        self._top_tenants = top_tenants
        self._admissions = meter.create_counter(
            "kvguard_admissions", description="Guarded requests by decision"
        )
        self._tenant_refusals = meter.create_counter(
            "kvguard_tenant_refusals",
            description="Refused requests by tenant: the configured ones, the rest as 'other'",
        )
        self._duration = meter.create_histogram(
            "kvguard_decision_duration",
            unit="s",
            description="Time from request body to decision",
            explicit_bucket_boundaries_advisory=DECISION_BUCKETS,
        )
        self._prompt_tokens = meter.create_histogram(
            "kvguard_prompt_tokens",
            description="Prompt tokens of admitted requests, as vLLM counts them",
            explicit_bucket_boundaries_advisory=PROMPT_BUCKETS,
        )
        self._completion_tokens = meter.create_histogram(
            "kvguard_completion_tokens",
            description="Completion tokens of released requests, where kvguard read them",
            explicit_bucket_boundaries_advisory=COMPLETION_BUCKETS,
        )
        self._ledger_errors = meter.create_counter(
            "kvguard_ledger_errors", description="Ledger calls that failed"
        )
        self._reloads = meter.create_counter(
            "kvguard_config_reloads", description="Policy reloads by result"
        )
        # Both series from the start: increase() then sees a process's first rejected reload.
        for result in ("applied", "rejected"):
            self._reloads.add(0, {"result": result})
        self._drain_cut = meter.create_counter(
            "kvguard_drain_cut_streams",
            description="ext_proc streams still open at drain_seconds, cut at shutdown",
        )
        meter.create_observable_gauge(
            "kvguard_reserved_blocks",
            callbacks=[self._per_pool(lambda: self.view.reserved)],
            description="KV blocks reserved in the pool (the ledger's shared view)",
        )
        meter.create_observable_gauge(
            "kvguard_capacity_blocks",
            callbacks=[self._per_pool(lambda: self.view.capacity)],
            description="Usable KV blocks of the pool",
        )
        meter.create_observable_gauge(
            "kvguard_engine_used_blocks",
            callbacks=[self._per_pool(lambda: self.view.used)],
            description="KV blocks vLLM reports in use in the pool (its kv_cache_usage_perc), "
            "to read against kvguard_reserved_blocks",
        )
        meter.create_observable_counter(
            "kvguard_engine_preemptions",
            callbacks=[self._per_pool(lambda: self.view.preemptions)],
            description="Preemptions the pool's vLLM servers counted since kvguard started "
            "reading them (their vllm:num_preemptions_total)",
        )
        meter.create_observable_gauge(
            "kvguard_engine_waiting_requests",
            callbacks=[self._per_pool(lambda: self.view.waiting)],
            description="Requests waiting in the queues of the pool's vLLM servers "
            "(their vllm:num_requests_waiting)",
        )
        meter.create_observable_gauge(
            "kvguard_reservation_trust",
            callbacks=[self._per_pool(lambda: self.view.trust)],
            description="How far the pool's calibrated reservations trust their estimate: "
            "1 reserves the estimate, 0 the worst case; preemptions lower it",
        )
        meter.create_observable_gauge(
            "kvguard_capacity_age",
            unit="s",
            callbacks=[self._per_pool(lambda: self.view.capacity_age_s)],
            description="Seconds since the pool's capacity was last discovered",
        )
        self._queue_wait = meter.create_histogram(
            "kvguard_queue_wait",
            unit="s",
            description="Time requests waited in a pool's queue, by what became of them",
            explicit_bucket_boundaries_advisory=QUEUE_WAIT_BUCKETS,
        )
        meter.create_observable_gauge(
            "kvguard_queued_requests",
            callbacks=[self._per_pool(lambda: self.view.queued)],
            description="Requests waiting in this process's queue of the pool",
        )
        meter.create_observable_gauge(
            "kvguard_promised_blocks",
            callbacks=[self._per_pool(lambda: self.view.promised)],
            description="KV blocks promised to the retries of refused requests (the ledger's "
            "shared view)",
        )
        meter.create_observable_gauge(
            "kvguard_tenant_reserved_blocks",
            callbacks=[self._observe_tenants],
            description="KV blocks reserved per tenant: the top tenants, the rest as 'other'",
        )
        meter.create_observable_gauge(
            "kvguard_pod_reserved_blocks",
            callbacks=[self._observe_pods],
            description="KV blocks reserved on each pod the pool discovered (routing: pick)",
        )
        meter.create_observable_gauge(
            "kvguard_ledger_available",
            callbacks=[self._single(lambda: self.view.ledger_available)],
            description="1 while the ledger is reachable (always on memory://), 0 while not",
        )
        meter.create_observable_gauge(
            "kvguard_capacity_known",
            callbacks=[self._per_pool(lambda: self.view.capacity_known)],
            description="1 when the pool's capacity is known (static or discovered), 0 when not",
        )
        meter.create_observable_gauge(
            "kvguard_ledger_replicas",
            callbacks=[self._single(lambda: self.view.replicas)],
            description="kvguard processes that on_unavailable: local divides the pool by",
        )

    def record_decision(
        self,
        *,
        pool: str,
        tier: str,
        outcome: str,
        reason: str,
        duration_s: float | None,
        prompt_tokens: int | None,
        tenant: str = "",
    ) -> None:
        """One guarded request's decision; `tenant` as Tenancy.metered_tenant labels it."""
        labels = {"pool": pool, "tier": tier, "outcome": outcome, "reason": reason}
        self._admissions.add(1, labels)
        if outcome in REFUSED_OUTCOMES:
            by_tenant = {"pool": pool, "tenant": tenant, "outcome": outcome, "reason": reason}
            self._tenant_refusals.add(1, by_tenant)
        if duration_s is not None:
            self._duration.record(duration_s)
        if prompt_tokens is not None and outcome == "admitted":
            self._prompt_tokens.record(prompt_tokens)

    def record_completion(self, *, pool: str, tier: str, completion_tokens: int) -> None:
        self._completion_tokens.record(completion_tokens, {"pool": pool, "tier": tier})

    def record_queued(self, pool: str, outcome: str, waited_s: float) -> None:
        """A request left the pool's queue: admitted, timed out, refused for a full queue, or
        gone (its client left, or the ledger failed)."""
        self._queue_wait.record(waited_s, {"pool": pool, "outcome": outcome})

    def record_ledger_error(self) -> None:
        self._ledger_errors.add(1)

    def record_reload(self, applied: bool) -> None:
        self._reloads.add(1, {"result": "applied" if applied else "rejected"})

    def record_drain_cut(self, streams: int) -> None:
        """Count the ext_proc streams still open when the drain ended: they were cut."""
        self._drain_cut.add(streams)

    @staticmethod
    def _per_pool(
        values: Callable[[], Mapping[str, float]],
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_: CallbackOptions) -> Iterable[Observation]:
            return [Observation(v, {"pool": pool}) for pool, v in values().items()]

        return observe

    @staticmethod
    def _single(
        value: Callable[[], float | None],
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        """One unlabelled series, absent while `value()` is None."""

        def observe(_: CallbackOptions) -> Iterable[Observation]:
            current = value()
            return [] if current is None else [Observation(current)]

        return observe

    def _observe_pods(self, _: CallbackOptions) -> Iterable[Observation]:
        for pool, pods in self.view.pods.items():
            for pod, blocks in pods.items():
                yield Observation(blocks, {"pool": pool, "pod": pod})

    def _observe_tenants(self, _: CallbackOptions) -> Iterable[Observation]:
        for pool, tenants in self.view.tenants.items():
            for tenant, blocks in bounded_tenants(tenants, self._top_tenants).items():
                yield Observation(blocks, {"pool": pool, "tenant": tenant})


def bounded_tenants(tenants: Mapping[str, int], top: int) -> dict[str, int]:
    """The `top` tenants by reserved blocks, the rest summed as "other" (bounded cardinality)."""
    ranked = sorted(tenants.items(), key=lambda item: (-item[1], item[0]))
    kept = dict(ranked[:top])
    rest = sum(blocks for _, blocks in ranked[top:])
    if rest:
        kept[OTHER_TENANTS] = kept.get(OTHER_TENANTS, 0) + rest
    return kept
