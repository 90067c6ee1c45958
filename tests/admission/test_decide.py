"""The pure decision, called directly: sizing, claims, refusals and the ledger's answers."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from kvguard.admission import decide
from kvguard.admission.calibration import DEFAULT_DECODE_RATE
from kvguard.admission.capacity import PodCapacity, PoolCapacity
from kvguard.config.schema import CapacityConfig, PoolConfig, TierConfig
from kvguard.errors import Code, Refusal
from kvguard.ledger import Claim, Outcome, PodLimit, Reservation, Terms

TIER = TierConfig(max_tokens_cap=512, default_max_tokens=256, max_blocks=100)
POOL = PoolConfig(
    name="llama",
    models=["llama"],
    tokenizer="/models/llama",
    max_model_len=4096,
    watermark=0.15,
    capacity=CapacityConfig(blocks=1000, block_size=16),
)
CAPACITY = PoolCapacity(1000, 16)


def counted(
    prompt_tokens: list[int], limits: dict[str, int] | None = None, **kw: int
) -> decide.Counted:
    return decide.Counted("completion", limits or {}, prompt_tokens, **kw)


def test_an_unknown_capacity_is_refused_with_503_and_retry_after() -> None:
    with pytest.raises(Refusal) as caught:
        decide.capacity_known("llama", None)
    refusal = caught.value
    assert (refusal.code, refusal.code.status) == (Code.CAPACITY_UNKNOWN, 503)
    assert refusal.message == "the KV-cache capacity of pool 'llama' is not known yet"
    assert refusal.retry_after_s == decide.RETRY_AFTER_S
    assert decide.capacity_known("llama", CAPACITY) is CAPACITY


def test_a_plan_clamps_the_limit_and_counts_every_prompt_and_sequence() -> None:
    plan = decide.plan(counted([100, 40], {"max_tokens": 9000}, n=2), POOL, "acme", TIER, CAPACITY)
    assert (plan.pool, plan.tenant) == ("llama", "acme")
    assert plan.limits.fields == {"max_tokens": 512} and plan.limits.clamped
    assert (plan.limits.requested, plan.limits.max_tokens) == (9000, 512)
    # ceil((100 + 512) / 16) + ceil((40 + 512) / 16) = 39 + 35, for each of 2 sequences
    assert plan.blocks == 2 * (39 + 35)
    assert (plan.quota, plan.pool_limit) == (100, 850)


def test_a_plan_without_a_limit_gets_the_tier_default() -> None:
    plan = decide.plan(counted([10]), POOL, "", TIER, CAPACITY)
    assert plan.limits.fields == {"max_tokens": 256} and plan.limits.requested is None
    assert plan.blocks == 17  # ceil(266 / 16)


def test_a_prompt_that_fills_the_context_is_refused() -> None:
    with pytest.raises(Refusal) as caught:
        decide.plan(counted([10, 4096], {"max_tokens": 5}), POOL, "", TIER, CAPACITY)
    assert caught.value.code is Code.CONTEXT_LENGTH_EXCEEDED
    assert caught.value.param == "prompt"


def test_min_tokens_above_the_room_is_refused_as_invalid() -> None:
    with pytest.raises(Refusal) as caught:
        decide.plan(counted([4000], min_tokens=200), POOL, "", TIER, CAPACITY)
    assert (caught.value.code, caught.value.param) == (Code.INVALID_REQUEST, "min_tokens")


def test_the_claim_carries_the_plan_the_lease_id_and_the_lease_seconds() -> None:
    plan = decide.plan(counted([100], {"max_tokens": 100}), POOL, "acme", TIER, CAPACITY)
    claim = decide.claim(plan, "lease-1", 30.0, decode_rate=50.0)
    # Its lease is expected to end once its limit is produced at the pool's decode rate.
    assert claim == Claim("lease-1", "llama", "acme", 13, 850, 100, 30.0, ends_in_s=2.0)
    unknown = decide.claim(plan, "lease-1", 30.0)
    assert unknown.ends_in_s == 100 / DEFAULT_DECODE_RATE


@pytest.mark.parametrize(
    ("tier", "capacity", "quota", "limit"),
    [
        (TierConfig(max_tokens_cap=512, default_max_tokens=256, max_blocks=12), CAPACITY, 12, 850),
        (TIER, PoolCapacity(14, 16), 100, 11),  # floor(14 x 0.85)
    ],
    ids=["above-the-quota", "above-the-pool-limit"],
)
def test_a_plan_above_the_quota_or_the_pool_limit_gets_no_claim(
    tier: TierConfig, capacity: PoolCapacity, quota: int, limit: int
) -> None:
    plan = decide.plan(counted([100], {"max_tokens": 100}), POOL, "acme", tier, capacity)
    assert plan.blocks == 13
    with pytest.raises(Refusal) as caught:
        decide.claim(plan, "lease-1", 30.0)
    refusal = caught.value
    assert (refusal.code, refusal.code.status) == (Code.REQUEST_EXCEEDS_CAPACITY, 400)
    assert refusal.message == (
        f"the request needs 13 KV-cache blocks, more than this tenant's quota ({quota}) or the "
        f"pool's admissible capacity ({limit}) allows; lower max_tokens, n or the prompt length"
    )
    assert refusal.retry_after_s is None


def test_a_plan_at_exactly_the_quota_and_the_pool_limit_is_claimed() -> None:
    tier = TierConfig(max_tokens_cap=512, default_max_tokens=256, max_blocks=13)
    plan = decide.plan(counted([100], {"max_tokens": 100}), POOL, "", tier, PoolCapacity(16, 16))
    assert (plan.blocks, plan.quota, plan.pool_limit) == (13, 13, 13)
    assert decide.claim(plan, "x", 1.0).blocks == 13


CLAIM = Claim("lease-1", "llama", "acme", 13, 850, 100, 30.0)


def answer(
    outcome: Outcome,
    wait_s: float = 0.0,
    retry_after_s: float | None = None,
    *,
    promised: bool = False,
) -> Reservation:
    """The ledger's answer to CLAIM: the pool holds 840 blocks, the tenant 90."""
    return Reservation(outcome, 840, 90, None, wait_s, retry_after_s, promised)


def test_the_ledgers_answers_map_to_429s_or_to_none() -> None:
    assert decide.refusal(answer(Outcome.ADMITTED), CLAIM) is None
    quota = decide.refusal(answer(Outcome.TENANT_QUOTA), CLAIM)
    assert quota is not None and quota.code is Code.TENANT_BLOCK_QUOTA_EXCEEDED
    assert quota.message == (
        "tenant quota of 100 KV-cache blocks in pool 'llama' is in use by this tenant's "
        "requests in flight; retry later"
    )
    full = decide.refusal(answer(Outcome.POOL_WATERMARK), CLAIM)
    assert full is not None and full.code is Code.KV_CACHE_WATERMARK_EXCEEDED
    assert full.message == "the KV cache of pool 'llama' is full; retry later"
    for refusal in (quota, full):
        assert (refusal.code.status, refusal.retry_after_s) == (429, decide.RETRY_AFTER_S)
        assert (refusal.should_retry, refusal.headers) == (None, {})


TERMS = Terms(max_wait_s=30.0, jitter_s=0.2, grace_s=2.0)
PROMISING = Claim("lease-1", "llama", "acme", 13, 850, 100, 30.0, "k" * 32, TERMS)


def test_a_promised_slot_is_the_retry_after_with_its_token() -> None:
    refusal = decide.refusal(answer(Outcome.POOL_WATERMARK, 2.0, 2.2, promised=True), PROMISING)
    assert refusal is not None
    assert (refusal.retry_after_s, refusal.should_retry) == (2.2, None)
    assert refusal.headers == {"x-kvguard-retry-token": "k" * 32}
    assert refusal.message.endswith(
        "this request's retry at the time retry-after-ms gives goes before this tenant's later "
        "requests"
    )
    told = decide.refusal(answer(Outcome.POOL_WATERMARK, 2.0, 2.2), PROMISING)
    assert told is not None and (told.retry_after_s, told.headers) == (2.2, {})
    assert told.message.endswith("room is expected at the time retry-after-ms gives")


def test_no_slot_within_max_wait_says_do_not_retry() -> None:
    refusal = decide.refusal(answer(Outcome.TENANT_QUOTA, 31.0), PROMISING)
    assert refusal is not None
    assert (refusal.retry_after_s, refusal.should_retry) == (None, False)
    assert "no room for this request is expected within 30 s" in refusal.message
    assert "x-kvguard-retry-token" not in refusal.headers


def test_rate_limit_headers_say_where_the_tenant_stands() -> None:
    refusal = decide.refusal(
        answer(Outcome.TENANT_QUOTA, 2.4, 2.6), PROMISING, rate_limit_headers=True
    )
    assert refusal is not None
    # 10 blocks left of the quota, 10 of the pool's limit; the blocks free in 2.4 s: t=3.
    assert refusal.headers["ratelimit-policy"] == '"kv";q=100'
    assert refusal.headers["ratelimit"] == '"kv";r=10;t=3'
    admitted = Reservation(Outcome.ADMITTED, 500, 20)
    assert decide.rate_limit(admitted, CLAIM).headers()["ratelimit"] == '"kv";r=80;t=0'
    # Blocks held for the tenant's promised retries are not its to reserve, in its quota or
    # in the pool.
    beside_held = Reservation(Outcome.ADMITTED, 500, 20, holding=5)
    assert decide.rate_limit(beside_held, CLAIM).headers()["ratelimit"] == '"kv";r=75;t=0'
    near_full = Reservation(Outcome.ADMITTED, 840, 20, holding=5)
    assert decide.rate_limit(near_full, CLAIM).headers()["ratelimit"] == '"kv";r=5;t=0'
    unknown = answer(Outcome.POOL_WATERMARK, float("inf"))
    assert decide.rate_limit(unknown, CLAIM).headers()["ratelimit"] == '"kv";r=10'


def test_an_unreachable_ledger_is_a_503_with_retry_after() -> None:
    refusal = decide.unavailable()
    assert (refusal.code, refusal.code.status) == (Code.LEDGER_UNAVAILABLE, 503)
    assert refusal.retry_after_s == decide.RETRY_AFTER_S


def test_shadow_mode_passes_capacity_refusals_never_malformed_input() -> None:
    passing = {code for code in Code if decide.passes_in_shadow(True, code)}
    assert passing == {
        Code.TENANT_BLOCK_QUOTA_EXCEEDED,
        Code.KV_CACHE_WATERMARK_EXCEEDED,
        Code.REQUEST_EXCEEDS_CAPACITY,
        Code.CAPACITY_UNKNOWN,
        Code.LEDGER_UNAVAILABLE,
    }
    assert not any(decide.passes_in_shadow(False, code) for code in Code)


# Runs in its own interpreter: an audit hook cannot be removed once added. The inputs are built
# and one request decided before the hook goes in, so imports and first-use caches are done; the
# hook then records every event of file, socket, process or OS access while a batch is decided.
_AUDITED = textwrap.dedent(
    """
    import json, sys
    from kvguard.admission import decide
    from kvguard.admission.capacity import PoolCapacity
    from kvguard.config.schema import CapacityConfig, PoolConfig, TierConfig
    from kvguard.errors import Refusal
    from kvguard.ledger import Outcome, Reservation

    pool = PoolConfig(name="p", models=["m"], tokenizer="/t", max_model_len=2048, watermark=0.1,
                capacity=CapacityConfig(blocks=500, block_size=16))
    tier = TierConfig(max_tokens_cap=256, default_max_tokens=64, max_blocks=120)
    capacity = PoolCapacity(500, 16)
    requests = [
        decide.Counted(kind, limits, prompts, min_tokens, n)
        for kind in ("chat", "completion")
        for limits in ({}, {"max_tokens": 100}, {"max_tokens": 900, "max_completion_tokens": 9})
        for prompts in ([1], [300, 20], [2047], [5000])
        for min_tokens in (0, 70, 400)
        for n in (1, 3)
    ]

    def batch():
        outcomes = []
        for i, request in enumerate(requests):
            try:
                known = decide.capacity_known("p", capacity if i % 7 else None)
                plan = decide.plan(request, pool, f"t{i % 3}", tier, known)
                claim = decide.claim(plan, f"lease-{i}", 30.0)
            except Refusal as refusal:
                outcomes.append(refusal.code.value)
                continue
            for outcome in Outcome:
                refused = decide.refusal(Reservation(outcome, 0, 0), claim)
                outcomes.append(refused.code.value if refused else claim.blocks)
            outcomes.append(decide.passes_in_shadow(True, decide.unavailable().code))
        return outcomes

    batch()
    FAMILIES = ("socket.", "os.", "subprocess.", "shutil.", "tempfile.", "glob.", "pathlib.",
                "http.", "urllib.", "ctypes.", "mmap.", "sqlite3.", "fcntl.", "signal.")
    events, recording = [], True

    def hook(event, args):
        if recording and (event in ("open", "import") or event.startswith(FAMILIES)):
            events.append(event)

    sys.addaudithook(hook)
    outcomes = batch()
    recording = False
    kinds = sorted(set(map(str, outcomes)))
    print(json.dumps({"events": events, "decided": len(requests), "kinds": kinds}))
    """
)


def test_the_decision_opens_no_file_and_no_socket() -> None:
    """Deciding a batch of requests, past import, touches no file, socket, process or OS."""
    done = subprocess.run(
        [sys.executable, "-c", _AUDITED], capture_output=True, text=True, timeout=120, check=True
    )
    report = json.loads(done.stdout)
    assert report["events"] == []
    assert report["decided"] == 144  # a batch, not one request
    # The batch reached every end: each refusal and each of the ledger's answers.
    assert {
        "capacity_unknown",
        "context_length_exceeded",
        "invalid_request",
        "request_exceeds_capacity",
        "tenant_block_quota_exceeded",
        "kv_cache_watermark_exceeded",
        "True",
    } <= set(report["kinds"])


def test_importing_the_decision_loads_no_ledger_backend_and_no_network_library() -> None:
    # import-linter sees imports between modules; this sees what Python really loads, parent
    # packages' __init__ included.
    loaded = subprocess.run(
        [sys.executable, "-c", "import json, sys, kvguard.admission.decide; "
         "print(json.dumps(sorted(sys.modules)))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    modules = json.loads(loaded.stdout)
    forbidden = ("kvguard.ledger.", "grpc", "aiohttp", "redis", "kvguard.ops", "kvguard.extproc")
    assert [m for m in modules if m.startswith(forbidden)] == []
    assert "kvguard.ledger" in modules  # the contract module (Claim, Outcome) is the one it uses


# --- the pods a request may be reserved on (routing: pick) ----------------------------------

PICKING = POOL.model_copy(
    update={"capacity": CapacityConfig(endpoints=["http://a:8000", "http://b:8000"])}
)
PODS = PoolCapacity(300, 16, (PodCapacity("a:8000", 100, 4), PodCapacity("b:8000", 200, 1)))


def test_the_pods_are_each_with_their_limit_the_shorter_queue_first() -> None:
    assert PICKING.picks and not POOL.picks
    assert decide.pod_limits(PICKING, PODS) == (PodLimit("b:8000", 170), PodLimit("a:8000", 85))
    routed = PICKING.model_copy(update={"routing": "envoy"})
    assert decide.pod_limits(routed, PODS) == ()  # the gateway balances: the pool's sum alone
    assert decide.pod_limits(POOL, PODS) == ()  # a static capacity has no pods to pick


def test_the_gateways_subset_restricts_the_pods_and_a_subset_of_none_is_503() -> None:
    subset = frozenset({"a:8000", "c:8000"})
    assert decide.pod_limits(PICKING, PODS, subset) == (PodLimit("a:8000", 85),)
    with pytest.raises(Refusal) as caught:
        decide.pod_limits(PICKING, PODS, frozenset({"c:8000"}))
    refusal = caught.value
    assert (refusal.code, refusal.code.status) == (Code.NO_ENDPOINT_IN_SUBSET, 503)
    assert refusal.retry_after_s == decide.RETRY_AFTER_S
    with pytest.raises(Refusal) as none_answer:  # no pod answered its last reading
        decide.pod_limits(PICKING, PoolCapacity(300, 16, ()))
    assert none_answer.value.code is Code.CAPACITY_UNKNOWN


def test_a_request_larger_than_every_pod_can_never_fit() -> None:
    # 95 blocks: within the pool's 255, the quota and b's 170; above a's 85.
    plan = decide.plan(counted([1600 - 256 - 16 * 5]), PICKING, "acme", TIER, PODS)
    assert plan.pods == (PodLimit("b:8000", 170), PodLimit("a:8000", 85))
    assert decide.claim(plan, "lease-1", 30.0).pods == plan.pods
    small = PoolCapacity(300, 16, (PodCapacity("a:8000", 100), PodCapacity("b:8000", 100)))
    plan = decide.plan(counted([1600 - 256 - 16 * 5]), PICKING, "acme", TIER, small)
    with pytest.raises(Refusal) as caught:
        decide.claim(plan, "lease-1", 30.0)
    assert caught.value.code is Code.REQUEST_EXCEEDS_CAPACITY
    assert "its largest pod's admissible capacity (85)" in caught.value.message
