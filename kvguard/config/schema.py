"""The configuration's schema: pydantic models, strict (unknown keys refused, values frozen).

`server` and `ledger` are process settings (a restart applies them; `KVGUARD_<SECTION>_<KEY>`
environment variables override them when the file is loaded). `tenancy`, `pools` and `shadow`
are the admission policy, an immutable snapshot that a request reads once.

A model check reports its problems at the keys they concern (`Problems`), so that the loader
(kvguard.config.loading) can name each key and find its line.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from kvguard.config.addresses import DNS_NAME, check_authority, listen_port
from kvguard.config.redact import redact

PositiveInt = Annotated[int, Field(strict=True, gt=0)]

# gRPC's message limits are twice max_body_bytes and a gRPC channel option is a C int.
MAX_BODY_BYTES_LIMIT = (2**31 - 1) // 2
# How tenancy.api_keys lists a key: the lowercase hex sha256 of it.
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
Key = tuple[str | int, ...]  # a path into the configuration, as pydantic locates errors


class Problems(ValueError):
    """A model check's problems, each at its path below the model (which names the key and
    finds its line)."""

    def __init__(self, *problems: tuple[Key, str]) -> None:
        super().__init__("; ".join(message for _, message in problems))
        self.problems = problems


def _raise_all(problems: list[tuple[Key, str]]) -> None:
    if problems:
        raise Problems(*problems)


# The metrics label of every tenant the configuration does not name.
OTHER_TENANTS = "other"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TlsConfig(_Strict):
    """TLS on the ext_proc port: the server's certificate (PEM, any chain after it) and its key,
    read when kvguard starts (a restart applies new files)."""

    certificate_file: Annotated[str, Field(min_length=1)]
    key_file: Annotated[str, Field(min_length=1)]


class ServerSettings(_Strict):
    grpc_listen: str = "127.0.0.1:50051"
    metrics_listen: str = "127.0.0.1:9464"
    max_body_bytes: PositiveInt = 8 * 1024 * 1024
    drain_seconds: Annotated[float, Field(ge=0)] = 30.0
    otlp_endpoint: str = ""
    admin: bool = False
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    workers: Annotated[int, Field(strict=True, ge=1, le=64)] = 1
    # The share of guarded exchanges whose response kvguard reads (docs/design.md, "The
    # response path"); 0 reads none.
    response_sample: Annotated[float, Field(ge=0, le=1)] = 0.05
    tls: TlsConfig | None = None  # None: plaintext, for a gateway on loopback or in the pod

    @field_validator("grpc_listen")
    @classmethod
    def _grpc_address(cls, value: str) -> str:
        listen_port(value, host_required=True)  # gRPC refuses an empty host
        return value

    @field_validator("metrics_listen")
    @classmethod
    def _metrics_address(cls, value: str) -> str:
        if value:  # empty disables the exposition; an empty host means every interface
            listen_port(value, host_required=False)
        return value

    @field_validator("max_body_bytes")
    @classmethod
    def _fits_grpc(cls, value: int) -> int:
        if value > MAX_BODY_BYTES_LIMIT:
            raise ValueError(
                f"at most {MAX_BODY_BYTES_LIMIT} (gRPC's message limit, twice this, "
                "must fit in 32 bits)"
            )
        return value


class LedgerSettings(_Strict):
    url: str = "memory://"
    cluster: bool = False
    lease_seconds: PositiveInt = 900
    on_unavailable: Literal["reject", "allow", "local"] = "reject"
    # The kvguard processes `local` divides the pool by: counted at runtime ("auto": those
    # alive in Redis, and replica_service's ready pods x workers), or at least a fixed N.
    replicas: PositiveInt | Literal["auto"] = "auto"
    replica_service: str | None = None  # a headless Service of the gateway pods, by DNS name

    @field_validator("replicas", mode="before")
    @classmethod
    def _replicas(cls, value: object) -> object:
        # One message for both forms (pydantic would report each member of the union).
        if value == "auto" or (type(value) is int and value >= 1):
            return value
        raise ValueError(
            f"{value!r} is neither auto (counted at runtime) nor a number of processes (1 or more)"
        )

    @field_validator("replica_service")
    @classmethod
    def _dns_name(cls, name: str | None) -> str | None:
        if name is not None and not DNS_NAME.fullmatch(name):
            raise ValueError(
                f"{name!r} is not a DNS name: give the headless Service's name, such as "
                "kvguard-gateway-pods or kvguard-gateway-pods.ns.svc (no scheme, no port)"
            )
        return name

    @field_validator("url")
    @classmethod
    def _ledger_url(cls, url: str) -> str:
        # The messages quote nothing but a scheme: the rest of a URL may hold a password.
        scheme = url.split("://", 1)[0] if "://" in url else ""
        if scheme in ("redis", "rediss"):
            check_authority(url)
            if not re.fullmatch(r"/?([0-9]+)?", urllib.parse.urlsplit(url).path):
                raise ValueError("the path must be a database number, such as /0")
        elif scheme != "memory":
            # A scheme as URLs spell one; anything else may be a password without its '://'.
            named = re.fullmatch(r"[A-Za-z][\w+.-]*", scheme)
            shown = f"scheme {scheme!r}" if named else "no scheme"
            raise ValueError(f"{shown}: it must be memory://, redis:// or rediss://")
        return url


ReservationMode = Literal["worst_case", "calibrated"]


class TierConfig(_Strict):
    max_tokens_cap: PositiveInt
    default_max_tokens: PositiveInt
    max_blocks: PositiveInt
    # Replaces the pool's reservation mode for this tier's requests; None keeps the pool's.
    reservation_mode: ReservationMode | None = None

    @model_validator(mode="after")
    def _default_within_cap(self) -> TierConfig:
        if self.default_max_tokens > self.max_tokens_cap:
            raise ValueError("default_max_tokens must not exceed max_tokens_cap")
        return self


class TenancyConfig(_Strict):
    identity: Literal["header", "api_key"] = "header"
    header: str = "x-tenant-id"
    api_keys: dict[str, str] = {}
    default_tier: str | None = None  # None: unknown tenants get 401 unknown_tenant
    tiers: dict[str, TierConfig] = {
        "free": TierConfig(max_tokens_cap=512, default_max_tokens=256, max_blocks=2000),
        "pro": TierConfig(max_tokens_cap=4096, default_max_tokens=1024, max_blocks=20000),
    }
    tenants: dict[str, str] = {}
    # Tell clients the output limit their request ran with (`x-kvguard-max-tokens`): a clamp
    # the client cannot see looks like a model that stops short.
    expose_limit_header: bool = True
    # Tell clients where they stand (`RateLimit` and `RateLimit-Policy`, in KV blocks).
    rate_limit_headers: bool = True
    _named_tenants: frozenset[str] = PrivateAttr(default=frozenset())

    @model_validator(mode="after")
    def _tiers_exist(self) -> TenancyConfig:
        problems: list[tuple[Key, str]] = []
        if not self.tiers:
            problems.append((("tiers",), "at least one tier is required"))
        if self.default_tier is not None and self.default_tier not in self.tiers:
            problems.append((("default_tier",), f"unknown tier {self.default_tier!r}"))
        for tenant, tier in self.tenants.items():
            if tier not in self.tiers:
                problems.append((("tenants", tenant), f"unknown tier {tier!r}"))
        for key_hash, tier_tenant in self.api_keys.items():
            if not SHA256_HEX.fullmatch(key_hash):
                problems.append(
                    (
                        ("api_keys", key_hash),
                        "not a sha256 digest: list the lowercase hex sha256 of each API key, "
                        "never the key itself",
                    )
                )
            elif not tier_tenant:
                problems.append((("api_keys", key_hash), "tenant must not be empty"))
        if self.header != self.header.lower() or not self.header:
            problems.append((("header",), "must be a non-empty lowercase header name"))
        _raise_all(problems)
        return self

    def tier_of(self, tenant: str) -> str | None:
        """The tier name of `tenant`: its mapping, else the default tier, else None."""
        return self.tenants.get(tenant, self.default_tier)

    def metered_tenant(self, tenant: str) -> str:
        """`tenant` as metrics label it: a tenant the configuration names (in `tenants` or as
        an API key's tenant) by its name, any other as OTHER_TENANTS (tenant values are the
        clients', so the label's values stay bounded by the configuration)."""
        return tenant if tenant in self._named_tenants else OTHER_TENANTS

    def model_post_init(self, context: object, /) -> None:
        self._named_tenants = frozenset(self.tenants) | frozenset(self.api_keys.values())


class CapacityConfig(_Strict):
    """Static (`blocks` usable blocks of `block_size` tokens) or discovered: from `endpoints`,
    the base URLs of the pool's vLLM servers, or from `service`, the `name:port` of a headless
    Service whose DNS records (A and AAAA, resolved again at every refresh) are its servers;
    their /metrics are read every `refresh_seconds`, with the Bearer key held in
    `api_key_file` when one is named (the file, not the key, is configured)."""

    blocks: PositiveInt | None = None
    block_size: PositiveInt | None = None
    endpoints: list[str] | None = None
    service: str | None = None
    refresh_seconds: Annotated[float, Field(gt=0, le=3600)] = 10.0
    api_key_file: str | None = None

    @property
    def discovered(self) -> bool:
        return bool(self.endpoints) or self.service is not None

    @model_validator(mode="after")
    def _one_source(self) -> CapacityConfig:
        static = self.blocks is not None or self.block_size is not None
        if self.endpoints and self.service is not None:
            raise ValueError("give either endpoints or service, not both")
        if static and self.discovered:
            what = "endpoints" if self.endpoints else "service"
            raise ValueError(f"give either blocks and block_size, or {what}, not both")
        if not self.discovered and (self.blocks is None or self.block_size is None):
            raise ValueError("blocks and block_size are both required without endpoints")
        if not self.discovered and "refresh_seconds" in self.model_fields_set:
            raise Problems(
                (("refresh_seconds",), "applies only to discovered capacity (endpoints)")
            )
        problems: list[tuple[Key, str]] = []
        if self.api_key_file is not None:
            # Never quoted: a value that is not a path may be the key itself, pasted in.
            if not self.discovered:
                problems.append(
                    (("api_key_file",), "applies only to discovered capacity (endpoints, service)")
                )
            elif not self.api_key_file.startswith("/") or "\n" in self.api_key_file:
                problems.append(
                    (
                        ("api_key_file",),
                        "give the absolute path of a file that holds the key (a mounted "
                        "Secret), never the key itself",
                    )
                )
        if self.service is not None:
            try:
                if listen_port(self.service, host_required=True) == 0:
                    raise ValueError(f"{self.service!r}: the port must be from 1 to 65535")
            except ValueError as exc:
                problems.append((("service",), f"{exc}: give the Service's name:port"))
        for i, url in enumerate(self.endpoints or []):
            if not re.fullmatch(r"https?://[^/\s]+(/\S*)?", url):
                problems.append(
                    (("endpoints", i), f"{redact(url)!r} is not an http:// or https:// URL")
                )
                continue
            try:
                check_authority(url)
            except ValueError as exc:
                problems.append((("endpoints", i), f"{redact(url)!r}: {exc}"))
        _raise_all(problems)
        return self


# Content-part types a pool may give a token cost (vLLM's media parts, as a request names them).
MEDIA_PART_TYPES = (
    "audio_embeds",
    "audio_url",
    "image_embeds",
    "image_url",
    "input_audio",
    "input_image",
    "video_url",
)


class ReservationConfig(_Strict):
    """What an admitted request reserves for its output (docs/configuration.md).

    `worst_case`: its whole clamped limit. `calibrated`: min(limit, max(min_tokens, estimate)),
    the estimate being the `quantile` of what this pool's requests of the tier (of the tenant,
    once it has `min_samples` of its own) produced over the last `window_seconds`; worst case
    until `min_samples` exist. Either way the limit sent to vLLM is the same."""

    mode: ReservationMode = "worst_case"
    quantile: Annotated[float, Field(ge=0.5, le=1)] = 0.5
    min_samples: PositiveInt = 50
    min_tokens: PositiveInt = 16
    window_seconds: Annotated[float, Field(gt=0, le=86400)] = 900.0


# Envoy holds a message for its answer at most max_message_timeout, which the shipped
# configurations (envoy/envoy.yaml, k8s/, the Istio EnvoyFilters) set to this many seconds; a
# queued request's wait and its counting must fit in it.
SHIPPED_MAX_MESSAGE_TIMEOUT_S = 35.0
COUNTING_BUDGET_S = 5.0
MAX_QUEUE_WAIT_S = SHIPPED_MAX_MESSAGE_TIMEOUT_S - COUNTING_BUDGET_S


class QueueConfig(_Strict):
    """A short queue before a 429 (docs/design.md, "A short queue before a 429")."""

    # How long a request refused for the quota or the watermark waits for blocks, holding its
    # stream, before its 429; 0 answers at once.
    max_wait_seconds: Annotated[float, Field(ge=0)] = 0.0
    max_queued: PositiveInt = 1000  # waiting requests per pool (per kvguard process) at most

    @field_validator("max_wait_seconds")
    @classmethod
    def _fits_envoys_timeout(cls, value: float) -> float:
        if value > MAX_QUEUE_WAIT_S:
            raise ValueError(
                f"at most {MAX_QUEUE_WAIT_S:g}: the wait and up to {COUNTING_BUDGET_S:g} s of "
                f"counting must fit in the {SHIPPED_MAX_MESSAGE_TIMEOUT_S:g} s that the shipped "
                "Envoy configurations hold a message for (max_message_timeout)"
            )
        return value


class PoolConfig(_Strict):
    name: str
    models: list[str] = Field(min_length=1)
    tokenizer: str
    chat_template: str | None = None
    max_model_len: PositiveInt
    watermark: Annotated[float, Field(ge=0, lt=1)] = 0.15
    capacity: CapacityConfig
    media_tokens: dict[str, PositiveInt] = {}  # tokens counted per media part of that type
    reservation: ReservationConfig = ReservationConfig()
    # A 429 promises the client a time to retry at (when the leases are expected to end),
    # when that time is at most this far; past it the client is told not to retry. 0 (the
    # default, chosen by measurement: docs/performance.md) makes no promises.
    retry_after_max_seconds: Annotated[float, Field(ge=0, le=3600)] = 0.0
    queue: QueueConfig = QueueConfig()
    # pick: kvguard reserves on one pod and names it to the gateway (the endpoint picker), so
    # that each pool's requests go to its own pods; envoy: the gateway balances, kvguard counts
    # the pool's sum. Absent: pick where the capacity is discovered (its pods are known).
    routing: Literal["pick", "envoy"] | None = None

    @property
    def picks(self) -> bool:
        """Whether kvguard picks the pod of each request of this pool."""
        if self.routing is not None:
            return self.routing == "pick"
        return self.capacity.discovered

    @model_validator(mode="after")
    def _pick_among_discovered_pods(self) -> PoolConfig:
        if self.routing == "pick" and not self.capacity.discovered:
            raise Problems(
                (
                    ("routing",),
                    "pick needs the pool's pods: discover the capacity from endpoints or a "
                    "service, or leave routing out",
                )
            )
        return self

    @model_validator(mode="after")
    def _known_media_parts(self) -> PoolConfig:
        _raise_all(
            [
                (
                    ("media_tokens", kind),
                    f"not a media content part type; use one of {', '.join(MEDIA_PART_TYPES)}",
                )
                for kind in self.media_tokens
                if kind not in MEDIA_PART_TYPES
            ]
        )
        return self


class Config(_Strict):
    server: ServerSettings = ServerSettings()
    ledger: LedgerSettings = LedgerSettings()
    tenancy: TenancyConfig = TenancyConfig()
    shadow: bool = False
    pools: list[PoolConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _workers_share_a_ledger(self) -> Config:
        if self.server.workers > 1 and self.ledger.url.startswith("memory://"):
            raise Problems(
                (
                    ("server", "workers"),
                    "several worker processes need a shared ledger (redis://); memory:// lives "
                    "in one process",
                )
            )
        return self

    @model_validator(mode="after")
    def _local_share_per_process(self) -> Config:
        # `local` gives each process capacity/replicas: fewer replicas than this process's
        # workers would let the workers together admit more than the pool.
        ledger, workers = self.ledger, self.server.workers
        fixed = ledger.replicas if isinstance(ledger.replicas, int) else None
        if ledger.on_unavailable == "local" and fixed is not None and fixed < workers:
            raise Problems(
                (
                    ("ledger", "replicas"),
                    f"{ledger.replicas} is below server.workers ({workers}); on_unavailable: "
                    "local admits capacity/replicas in each process, so count every process: "
                    "replicas = pods x workers",
                )
            )
        return self

    @model_validator(mode="after")
    def _unique_names(self) -> Config:
        problems: list[tuple[Key, str]] = []
        seen_pools: set[str] = set()
        seen_models: dict[str, str] = {}
        for i, pool in enumerate(self.pools):
            if pool.name in seen_pools:
                problems.append((("pools", i, "name"), f"duplicate pool name {pool.name!r}"))
            seen_pools.add(pool.name)
            for model in pool.models:
                if model in seen_models:
                    problems.append(
                        (
                            ("pools", i, "models"),
                            f"{model!r} is already served by pool {seen_models[model]!r}",
                        )
                    )
                else:
                    seen_models[model] = pool.name
        _raise_all(problems)
        return self
