"""Every kvguard instrument, created here and fed through named functions.

Handlers never touch OpenTelemetry types. The MeterProvider is an argument, so tests read exact
values with the SDK's in-memory reader. Prometheus names (a contract: dashboards use them):

    kvguard_admissions_total{pool,tier,outcome,reason}   one per guarded request, where
        outcome: admitted | refused | shadow_refused | cancelled (OUTCOMES)
        reason: the refusal code; "" when admitted or cancelled
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
    kvguard_capacity_age_seconds{pool}                   age of the last capacity discovery
    kvguard_ledger_errors_total                          ledger calls that failed
    kvguard_config_reloads_total{result}                 result: applied|rejected
    kvguard_drain_cut_streams_total                      streams still open at drain_seconds, cut
    kvguard_queued_requests{pool}                        requests waiting in this process's queue
    kvguard_queue_wait_seconds{pool,outcome}             histogram, one per request that queued,
        outcome: admitted | timed_out | full | left | failed (admission.queue)
    kvguard_promised_blocks{pool}                        blocks promised to 429s' retries (the
        ledger's shared view)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation

# Seconds: from the short decisions of small prompts, past the long counts of 32k-token ones,
# to the 200 ms after which Envoy gives up on an answer.
DECISION_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
PROMPT_BUCKETS = (16, 64, 256, 1024, 4096, 8192, 16384, 32768, 65536, 131072)
# vLLM's own bounds for vllm:request_generation_tokens, then the longer limits tiers allow.
COMPLETION_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 4096, 8192, 16384, 32768)
OTHER_TENANTS = "other"
# Seconds a request waits in a pool's queue: up to the longest wait the configuration allows.
QUEUE_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0)
# kvguard_admissions_total's outcome label, admission.record.Decision.outcome: admitted; refused
# (kvguard answered with an error); shadow_refused (shadow mode: it would refuse, and let the
# request through); cancelled (the stream ended before the answer went out).
OUTCOMES = ("admitted", "refused", "shadow_refused", "cancelled")


@dataclass
class LedgerView:
    """The last values read from the ledger and discovery; the gauges report these."""

    reserved: dict[str, int] = field(default_factory=dict)  # pool -> blocks
    tenants: dict[str, dict[str, int]] = field(default_factory=dict)  # pool -> tenant -> blocks
    capacity: dict[str, int] = field(default_factory=dict)  # pool -> blocks
    used: dict[str, int] = field(default_factory=dict)  # pool -> blocks vLLM holds
    preemptions: dict[str, int] = field(default_factory=dict)  # pool -> since kvguard started
    waiting: dict[str, int] = field(default_factory=dict)  # pool -> requests in vLLM's queue
    trust: dict[str, float] = field(default_factory=dict)  # pool -> 0 (worst case) to 1
    promised: dict[str, int] = field(default_factory=dict)  # pool -> blocks promised to retries
    queued: dict[str, int] = field(default_factory=dict)  # pool -> requests waiting here
    capacity_age_s: dict[str, float] = field(default_factory=dict)  # pool -> seconds


class Metrics:
    def __init__(self, provider: MeterProvider, *, top_tenants: int = 20) -> None:
        meter = provider.get_meter("kvguard")
        self.view = LedgerView()
        self._top_tenants = top_tenants
        self._admissions = meter.create_counter(
            "kvguard_admissions", description="Guarded requests by decision"
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

    def record_decision(
        self,
        *,
        pool: str,
        tier: str,
        outcome: str,
        reason: str,
        duration_s: float | None,
        prompt_tokens: int | None,
    ) -> None:
        labels = {"pool": pool, "tier": tier, "outcome": outcome, "reason": reason}
        self._admissions.add(1, labels)
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
