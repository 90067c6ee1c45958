"""The admission policy as requests see it: an immutable snapshot built from a valid Config.

A request reads `Policy` once and uses that snapshot to the end, so a reload never changes the
rules under a request in flight.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvguard.admission.calibration import DEFAULT_DECODE_RATE, calibrated
from kvguard.admission.capacity import PoolCapacity, pool_limit
from kvguard.admission.sizing import blocks_needed, clamp
from kvguard.config.schema import Config, PoolConfig, TenancyConfig, TierConfig
from kvguard.errors import Code, Refusal
from kvguard.tokens import messages_api
from kvguard.tokens.tokenizer import PoolTokenizer


@dataclass(frozen=True, slots=True)
class PoolPolicy:
    config: PoolConfig
    tokenizer: PoolTokenizer
    static_capacity: PoolCapacity | None  # None when capacity is discovered from endpoints

    @property
    def name(self) -> str:
        return self.config.name


@dataclass(frozen=True, slots=True)
class Identity:
    tenant: str
    tier_name: str
    tier: TierConfig


@dataclass(frozen=True, slots=True)
class Policy:
    tenancy: TenancyConfig
    shadow: bool
    pools: dict[str, PoolPolicy]  # by pool name
    by_model: dict[str, PoolPolicy]  # by request "model" value

    def pool_config(self, name: str) -> PoolConfig | None:
        """The configuration of pool `name`; None when this policy has no such pool."""
        pool = self.pools.get(name)
        return pool.config if pool is not None else None


def known(tenancy: TenancyConfig, tenant: str) -> Identity:
    """The tenant's tier in `tenancy` (the default tier for an unmapped one); refused with 401
    unknown_tenant when there is none."""
    tier_name = tenancy.tier_of(tenant)
    if tier_name is None:
        raise Refusal(Code.UNKNOWN_TENANT, "the request carries no known tenant identity")
    return Identity(tenant, tier_name, tenancy.tiers[tier_name])


def identify_request(policy: Policy, headers: Mapping[str, str]) -> Identity:
    """The tenant of a request, by the configured header or by its API key's sha256.

    A missing or unmapped identity gets the default tier (its tenant value, or "" when there
    is none, keys its quota); without a default tier it is refused with 401 unknown_tenant.
    """
    tenancy = policy.tenancy
    if tenancy.identity == "header":
        tenant = headers.get(tenancy.header, "")
    else:
        scheme, _, key = headers.get("authorization", "").partition(" ")
        digest = hashlib.sha256(key.strip().encode()).hexdigest()
        tenant = tenancy.api_keys.get(digest, "") if scheme.lower() == "bearer" else ""
    return known(tenancy, tenant)


# A file as the tokenizer cache knows it: resolved path, inode, mtime (ns) and size; None when
# absent. A ConfigMap update swaps the `..data` symlink, so the resolved path changes too.
FileIdentity = tuple[str, int, int, int] | None
TokenizerKey = tuple[str, str | None, tuple[FileIdentity, ...]]
TokenizerCache = dict[TokenizerKey, PoolTokenizer]


def build(config: Config, tokenizers: TokenizerCache | None = None) -> Policy:
    """Load every pool's tokenizer (reusing `tokenizers` entries) and snapshot the policy.

    An entry is reused only while its files are the same ones (by stat, nothing is read), so a
    template or tokenizer changed at the same path is loaded again; entries the new policy does
    not use are dropped. Raises whatever loading a tokenizer raises; the caller keeps its last
    good policy then (and `tokenizers` keeps the entries that policy uses).
    """
    cache = {} if tokenizers is None else tokenizers
    pools: dict[str, PoolPolicy] = {}
    used: set[TokenizerKey] = set()
    for pool in config.pools:
        # Stat before loading: a file that changes in between is loaded again next time.
        key = tokenizer_key(pool)
        if key not in cache:
            cache[key] = PoolTokenizer.load(Path(pool.tokenizer), pool.chat_template)
            messages_api.probe(cache[key])  # once here, not on a request's path
        used.add(key)
        capacity = None
        if pool.capacity.blocks is not None and pool.capacity.block_size is not None:
            capacity = PoolCapacity(pool.capacity.blocks, pool.capacity.block_size)
        pools[pool.name] = PoolPolicy(pool, cache[key], capacity)
    for unused in [key for key in cache if key not in used]:
        del cache[unused]
    by_model = {model: pools[p.name] for p in config.pools for model in p.models}
    return Policy(config.tenancy, config.shadow, pools, by_model)


def tokenizer_key(pool: PoolConfig) -> TokenizerKey:
    """The pool's tokenizer paths as configured and the identity of each file loading reads."""
    files = PoolTokenizer.files(pool.tokenizer, pool.chat_template)
    return (pool.tokenizer, pool.chat_template, tuple(_identity(path) for path in files))


def _identity(path: Path) -> FileIdentity:
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return None  # loading says what is missing
    return (real, st.st_ino, st.st_mtime_ns, st.st_size)


def warnings(config: Config) -> list[str]:
    """Settings that validate but can never admit what they seem to: "key: why" lines.

    A tenancy with no default tier that maps no tenant refuses every request with 401. Only
    pools with static capacity are judged (a discovered capacity is not known here): a tier
    whose request without a limit (one prompt token + the injected default) needs more blocks
    than the tier's quota or the pool's limit allows, so every such request is refused; and a
    tier quota at or above every pool's limit, which then never binds. A calibrated pool with
    static capacity and `server.response_sample` 0 has nothing to learn from (no vLLM histogram
    is read, no response either): it reserves the worst case for ever; with responses to
    learn from, it still lacks the loop with vLLM's preemptions and its decode rate. A Redis
    ledger whose `local` fallback counts its replicas only in Redis cannot fall back in a
    process that never reached Redis. API-key identity with a default tier admits requests
    without a known key. A pool of several vLLM servers routed by the gateway (`routing:
    envoy`) guarantees nothing per server.
    """
    out = []
    tenancy = config.tenancy
    if tenancy.identity == "api_key" and tenancy.default_tier is not None:
        out.append(
            f"tenancy.default_tier: with identity api_key, a request with no key or a key not "
            f"in api_keys is admitted on tier {tenancy.default_tier!r}: anyone who can reach "
            "the gateway gets that tier; leave default_tier out to answer such requests 401 "
            "unknown_tenant"
        )
    if tenancy.default_tier is None:
        if not tenancy.tenants:
            out.append(
                "tenancy: no default_tier and no tenants: every request gets 401 unknown_tenant"
            )
        elif tenancy.identity == "api_key" and not set(tenancy.api_keys.values()) & set(
            tenancy.tenants
        ):
            out.append(
                "tenancy: no default_tier and no API key of api_keys names a tenant of tenants: "
                "every request gets 401 unknown_tenant"
            )
    static = [p for p in config.pools if p.capacity.blocks and p.capacity.block_size]
    limits = {p.name: pool_limit(p.capacity.blocks or 0, p.watermark) for p in static}
    for name, tier in config.tenancy.tiers.items():
        key = f"tenancy.tiers.{name}"
        for pool in static:
            try:
                max_tokens = clamp("chat", {}, tier, pool.max_model_len, 1).max_tokens
            except Refusal:
                continue  # max_model_len 1: every prompt is refused as too long anyway
            need = blocks_needed([1], max_tokens, 1, pool.capacity.block_size or 1)
            bound, what = min(
                (tier.max_blocks, "this tier's max_blocks"),
                (limits[pool.name], "the pool's limit, capacity x (1 - watermark)"),
            )
            if need > bound:
                out.append(
                    f"{key}.default_max_tokens: in pool {pool.name}, a request without "
                    f"max_tokens gets {max_tokens} and needs at least {need} blocks, more than "
                    f"{what} ({bound}): every such request is refused (400 "
                    "request_exceeds_capacity)"
                )
        if static and len(static) == len(config.pools):
            widest = max(static, key=lambda p: limits[p.name])
            if tier.max_blocks >= limits[widest.name]:
                out.append(
                    f"{key}.max_blocks: {tier.max_blocks} is not below any pool's limit (at most "
                    f"{limits[widest.name]} blocks, pool {widest.name}): this quota never binds, "
                    "so one tenant of this tier may take a whole pool"
                )
    for i, pool in enumerate(config.pools):
        if not calibrated(pool, tenancy.tiers.values()) or pool.capacity.discovered:
            continue
        if config.server.response_sample == 0:
            out.append(
                f"pools[{i}].reservation.mode: calibrated, but with server.response_sample 0 "
                "and a static capacity nothing is learnt (no response is read, no vLLM "
                "histogram scraped): every request reserves the worst case"
            )
        else:
            out.append(
                f"pools[{i}].reservation.mode: calibrated with a static capacity: no vLLM "
                "/metrics is read, so preemptions cannot move reservations back towards the "
                f"worst case and leases grow at an assumed {DEFAULT_DECODE_RATE:g} tokens/s; "
                "discover the capacity from the pool's endpoints"
            )
    for i, pool in enumerate(config.pools):
        several = pool.capacity.service is not None or len(pool.capacity.endpoints or []) > 1
        if several and pool.routing == "envoy":
            out.append(
                f"pools[{i}].routing: envoy over several vLLM servers counts only the pool's "
                "sum: the gateway's balancing can send more to one server than it holds, and "
                "vLLM preempts there; nothing is guaranteed per server (routing pick reserves "
                "on one and names it to the gateway)"
            )
    ledger = config.ledger
    if (
        ledger.on_unavailable == "local"
        and ledger.url.startswith(("redis://", "rediss://"))
        and ledger.replicas == "auto"
        and ledger.replica_service is None
    ):
        out.append(
            "ledger.replica_service: on_unavailable local counts its replicas from Redis "
            "alone: a process that starts while Redis is down refuses with 503 until it "
            "reaches Redis once; name the gateway pods' headless Service to count them in DNS"
        )
    return out
