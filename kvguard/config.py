"""Configuration: one YAML file, validated strictly.

`server` and `ledger` are process settings (a restart applies them; `KVGUARD_<SECTION>_<KEY>`
environment variables override them). `tenancy`, `pools` and `shadow` are the admission policy,
an immutable snapshot that a request reads once.

Every error names the file, the dotted key and, where the file has it, its line, e.g.
``kvguard.yaml: pools[0].capacity.blocks: Input should be greater than 0 (line 12)``; a file
with several errors gets them all, one a line.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import types
import urllib.parse
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

PositiveInt = Annotated[int, Field(strict=True, gt=0)]

# gRPC's message limits are twice max_body_bytes and a gRPC channel option is a C int.
MAX_BODY_BYTES_LIMIT = (2**31 - 1) // 2
# host:port, the host a name, an IPv4 address or a bracketed IPv6 address.
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[\w.-]*):([0-9]{1,5})", re.ASCII)


class ConfigError(Exception):
    """A configuration that cannot be used: `problems` holds one line per error, each naming
    the file and the key; the message is those lines."""

    def __init__(self, *problems: str) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


def _raise_all(problems: list[str]) -> None:
    """A model check's problems, each "key: message", as one error that `parse` splits."""
    if problems:
        raise ValueError("\n".join(problems))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _listen_port(address: str, *, host_required: bool) -> int:
    """The port of a `host:port` listen address (0: the kernel picks one); ValueError if it is
    not one."""
    match = _HOST_PORT.fullmatch(address)
    if not match or (host_required and not match.group(1)):
        form = "host:port" if host_required else "host:port or :port"
        raise ValueError(f"{address!r} is not {form}")
    port = int(match.group(2))
    if port > 65535:
        raise ValueError(f"{address!r}: the port must be from 0 to 65535")
    return port


class ServerSettings(_Strict):
    grpc_listen: str = "127.0.0.1:50051"
    metrics_listen: str = "127.0.0.1:9464"
    max_body_bytes: PositiveInt = 8 * 1024 * 1024
    drain_seconds: Annotated[float, Field(ge=0)] = 30.0
    otlp_endpoint: str = ""
    admin: bool = False
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    workers: Annotated[int, Field(strict=True, ge=1, le=64)] = 1

    @field_validator("grpc_listen")
    @classmethod
    def _grpc_address(cls, value: str) -> str:
        _listen_port(value, host_required=True)  # gRPC refuses an empty host
        return value

    @field_validator("metrics_listen")
    @classmethod
    def _metrics_address(cls, value: str) -> str:
        if value:  # empty disables the exposition; an empty host means every interface
            _listen_port(value, host_required=False)
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

    @model_validator(mode="after")
    def _worker_metrics_ports(self) -> ServerSettings:
        port = _listen_port(self.metrics_listen, host_required=False) if self.metrics_listen else 0
        if port and port + self.workers - 1 > 65535:
            raise ValueError(
                f"metrics_listen: worker i serves port {port} + i, past 65535 with "
                f"{self.workers} workers"
            )
        return self


class LedgerSettings(_Strict):
    url: str = "memory://"
    cluster: bool = False
    lease_seconds: PositiveInt = 900
    on_unavailable: Literal["reject", "allow", "local"] = "reject"
    replicas: PositiveInt = 1

    @field_validator("url")
    @classmethod
    def _redis_url(cls, url: str) -> str:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("redis", "rediss"):
            return url  # memory://, or a scheme the model check refuses
        # The messages quote nothing: a password with '/', '?' or '#' spills into the rest.
        address = parts.netloc.rpartition("@")[2]
        if ":" in address.rpartition("]")[2]:  # a port, after any [IPv6] host
            port = address.rpartition(":")[2]
            if not re.fullmatch(r"[0-9]{1,5}", port) or not 0 < int(port) <= 65535:
                raise ValueError(
                    "the port must be a number from 1 to 65535 (in a password, "
                    "'/', '?' and '#' must be percent-encoded)"
                )
        if not re.fullmatch(r"/?([0-9]+)?", parts.path):
            raise ValueError("the path must be a database number, such as /0")
        return url

    @model_validator(mode="after")
    def _known_scheme(self) -> LedgerSettings:
        scheme = self.url.split("://", 1)[0] if "://" in self.url else ""
        if scheme not in ("memory", "redis", "rediss"):
            # The scheme alone: the rest of a URL may hold a password.
            raise ValueError(f"url scheme {scheme!r}: it must be memory://, redis:// or rediss://")
        return self


class Tier(_Strict):
    max_tokens_cap: PositiveInt
    default_max_tokens: PositiveInt
    max_blocks: PositiveInt

    @model_validator(mode="after")
    def _default_within_cap(self) -> Tier:
        if self.default_max_tokens > self.max_tokens_cap:
            raise ValueError("default_max_tokens must not exceed max_tokens_cap")
        return self


class Tenancy(_Strict):
    identity: Literal["header", "api_key"] = "header"
    header: str = "x-tenant-id"
    api_keys: dict[str, str] = {}
    default_tier: str | None = None  # None: unknown tenants get 401 unknown_tenant
    tiers: dict[str, Tier] = {
        "free": Tier(max_tokens_cap=512, default_max_tokens=256, max_blocks=2000),
        "pro": Tier(max_tokens_cap=4096, default_max_tokens=1024, max_blocks=20000),
    }
    tenants: dict[str, str] = {}
    # Tell clients the output limit their request ran with (`x-kvguard-max-tokens`).
    expose_limit_header: bool = False

    @model_validator(mode="after")
    def _tiers_exist(self) -> Tenancy:
        problems = []
        if not self.tiers:
            problems.append("tiers: at least one tier is required")
        if self.default_tier is not None and self.default_tier not in self.tiers:
            problems.append(f"default_tier: unknown tier {self.default_tier!r}")
        for tenant, tier in self.tenants.items():
            if tier not in self.tiers:
                problems.append(f"tenants.{tenant}: unknown tier {tier!r}")
        for key_hash, tier_tenant in self.api_keys.items():
            if not re.fullmatch(r"[0-9a-f]{64}", key_hash):
                problems.append(f"api_keys.{key_hash}: must be a lowercase sha256 hex digest")
            elif not tier_tenant:
                problems.append(f"api_keys.{key_hash}: tenant must not be empty")
        if self.header != self.header.lower() or not self.header:
            problems.append("header: must be a non-empty lowercase header name")
        _raise_all(problems)
        return self

    def tier_of(self, tenant: str) -> str | None:
        """The tier name of `tenant`: its mapping, else the default tier, else None."""
        return self.tenants.get(tenant, self.default_tier)


class Capacity(_Strict):
    """Static (`blocks` usable blocks of `block_size` tokens) or discovered (`endpoints`, the
    base URLs of the pool's vLLM servers, whose /metrics are read every `refresh_seconds`)."""

    blocks: PositiveInt | None = None
    block_size: PositiveInt | None = None
    endpoints: list[str] | None = None
    refresh_seconds: Annotated[float, Field(gt=0, le=3600)] = 10.0

    @model_validator(mode="after")
    def _one_source(self) -> Capacity:
        static = self.blocks is not None or self.block_size is not None
        if static and self.endpoints:
            raise ValueError("give either blocks and block_size, or endpoints, not both")
        if not self.endpoints and (self.blocks is None or self.block_size is None):
            raise ValueError("blocks and block_size are both required without endpoints")
        if not self.endpoints and "refresh_seconds" in self.model_fields_set:
            raise ValueError("refresh_seconds: applies only to discovered capacity (endpoints)")
        for i, url in enumerate(self.endpoints or []):
            if not re.fullmatch(r"https?://[^/\s]+(/\S*)?", url):
                raise ValueError(f"endpoints[{i}]: {url!r} is not an http:// or https:// URL")
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


class Pool(_Strict):
    name: str
    models: list[str] = Field(min_length=1)
    tokenizer: str
    chat_template: str | None = None
    max_model_len: PositiveInt
    watermark: Annotated[float, Field(ge=0, lt=1)] = 0.15
    capacity: Capacity
    media_tokens: dict[str, PositiveInt] = {}  # tokens counted per media part of that type

    @model_validator(mode="after")
    def _known_media_parts(self) -> Pool:
        for kind in self.media_tokens:
            if kind not in MEDIA_PART_TYPES:
                raise ValueError(
                    f"media_tokens.{kind}: not a media content part type; "
                    f"use one of {', '.join(MEDIA_PART_TYPES)}"
                )
        return self


class Config(_Strict):
    server: ServerSettings = ServerSettings()
    ledger: LedgerSettings = LedgerSettings()
    tenancy: Tenancy = Tenancy()
    shadow: bool = False
    pools: list[Pool] = Field(min_length=1)

    @model_validator(mode="after")
    def _workers_share_a_ledger(self) -> Config:
        if self.server.workers > 1 and self.ledger.url.startswith("memory://"):
            raise ValueError(
                "server.workers: several worker processes need a shared ledger (redis://); "
                "memory:// lives in one process"
            )
        return self

    @model_validator(mode="after")
    def _local_share_per_process(self) -> Config:
        # `local` gives each process capacity/replicas: fewer replicas than this process's
        # workers would let the workers together admit more than the pool.
        ledger, workers = self.ledger, self.server.workers
        if ledger.on_unavailable == "local" and ledger.replicas < workers:
            raise ValueError(
                f"ledger.replicas: {ledger.replicas} is below server.workers ({workers}); "
                "on_unavailable: local admits capacity/replicas in each process, so count every "
                "process: replicas = pods x workers"
            )
        return self

    @model_validator(mode="after")
    def _unique_names(self) -> Config:
        problems = []
        seen_pools: set[str] = set()
        seen_models: dict[str, str] = {}
        for i, pool in enumerate(self.pools):
            if pool.name in seen_pools:
                problems.append(f"pools[{i}].name: duplicate pool name {pool.name!r}")
            seen_pools.add(pool.name)
            for model in pool.models:
                if model in seen_models:
                    problems.append(
                        f"pools[{i}].models: {model!r} is already served by pool "
                        f"{seen_models[model]!r}"
                    )
                else:
                    seen_models[model] = pool.name
        _raise_all(problems)
        return self


Key = tuple[str | int, ...]  # a path into the configuration, as pydantic locates errors
_MERGE_TAG = "tag:yaml.org,2002:merge"


def _key_path(loc: tuple[Any, ...]) -> Key:
    """A pydantic error location without the names of validators and union members."""
    return tuple(
        part
        for part in loc
        if isinstance(part, int)
        or not (str(part).startswith("function-") or str(part) in {"int", "float"})
    )


def _dotted(path: Key) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + part
    return out


def _parse_dotted(key: str) -> Key:
    return tuple(
        int(index) if index else name for index, name in re.findall(r"\[(\d+)\]|([^.\[\]]+)", key)
    )


def _key_lines(root: yaml.Node) -> dict[Key, int]:
    """The line (from 1) of each key and list item of a composed YAML document. A mapping's
    merged keys (`<<: *base`) are where the anchor gave them, its own keys override them."""
    lines: dict[Key, int] = {}
    stack: list[tuple[Key, yaml.Node, frozenset[int]]] = [((), root, frozenset())]
    while stack:
        path, node, above = stack.pop()
        if id(node) in above:
            continue  # a recursive alias
        above |= {id(node)}
        children: dict[str | int, tuple[yaml.Node, yaml.Node]] = {}
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:  # flattened by construction: merged pairs first
                if isinstance(key, yaml.ScalarNode) and key.tag != _MERGE_TAG:
                    children[key.value] = (key, value)
        elif isinstance(node, yaml.SequenceNode):
            children = {i: (item, item) for i, item in enumerate(node.value)}
        for part, (mark, value) in children.items():
            lines[(*path, part)] = mark.start_mark.line + 1
            stack.append(((*path, part), value, above))
    return lines


def _line_of(path: Key, lines: dict[Key, int]) -> int | None:
    """The line of the key at `path`, else of its nearest enclosing key that the file has (a
    missing key belongs there); None at the top level."""
    for end in range(len(path), 0, -1):
        if path[:end] in lines:
            return lines[path[:end]]
    return None


def _accepted_keys(path: Key) -> list[str]:
    """The keys the model at `path` accepts; [] where no model is."""
    annotation: Any = Config
    for part in path:
        if get_origin(annotation) in (types.UnionType, Union):
            members = [a for a in get_args(annotation) if a is not type(None)]
            annotation = members[0] if len(members) == 1 else None
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(part) if isinstance(part, str) else None
            annotation = field.annotation if field else None
        elif get_origin(annotation) is list and isinstance(part, int):
            annotation = get_args(annotation)[0]
        elif get_origin(annotation) is dict and isinstance(part, str):
            annotation = get_args(annotation)[1]
        else:
            return []
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return list(annotation.model_fields)
    return []


def _problems(
    error: Any, source: str, lines: dict[Key, int], overridden: dict[str, str]
) -> list[str]:
    """One line per problem of a pydantic error: `source: key: message (line N)`."""
    base = _key_path(tuple(error["loc"]))
    message = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] == "extra_forbidden" and base and isinstance(base[-1], str):
        close = difflib.get_close_matches(base[-1], _accepted_keys(base[:-1]), n=1)
        if close:
            message += f"; did you mean {close[0]!r}?"
    out = []
    for text in message.split("\n"):
        path = base
        # A model-level check names its own key first ("tenants.acme: ..."): join the two.
        nested = re.match(r"([\w.\[\]-]+): (.*)", text, re.DOTALL)
        if nested:
            path, text = (*base, *_parse_dotted(nested.group(1))), nested.group(2)
        location = _dotted(path) or "(top level)"
        if location in overridden:
            text += f" (set by {overridden[location]})"
        elif (line := _line_of(path, lines)) is not None:
            text += f" (line {line})"
        out.append(f"{source}: {location}: {text}")
    return out


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, line: int) -> None:
        super().__init__(f"line {line}: duplicate key {key!r}")


class _UniqueKeyLoader(yaml.SafeLoader):
    """The safe loader, refusing a key given twice in one mapping (YAML would keep the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` entries may be overridden, that is their purpose
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:
                continue  # unhashable: the safe loader itself refuses it
            if duplicate:
                raise _DuplicateKey(key, key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _is_text(annotation: Any) -> bool:
    """A str field, or a Literal of strings."""
    if get_origin(annotation) is Literal:
        return all(isinstance(arg, str) for arg in get_args(annotation))
    return annotation is str


def _env_overrides(raw: dict[str, Any], environ: dict[str, str]) -> dict[str, str]:
    """Apply KVGUARD_<SECTION>_<KEY> to the process settings; {"section.key": variable} of those
    applied. A text setting takes the value as given (YAML would read `10:50` as 650 and cut
    ` #x`); others read it as a YAML scalar (`60`, `true`), or as given if it is not YAML."""
    applied: dict[str, str] = {}
    for section, model in (("server", ServerSettings), ("ledger", LedgerSettings)):
        for key, field in model.model_fields.items():
            name = f"KVGUARD_{section}_{key}".upper()
            value = environ.get(name)
            if value is None:
                continue
            target = raw.setdefault(section, {})
            if not isinstance(target, dict):
                return applied  # validation reports the wrong type
            target[key] = value
            if value and not _is_text(field.annotation):
                # Not YAML: validation refuses the text, naming the key and the variable.
                with contextlib.suppress(yaml.YAMLError, RecursionError):
                    target[key] = yaml.safe_load(value)
            applied[f"{section}.{key}"] = name
    return applied


def _read_yaml(text: str) -> tuple[Any, dict[Key, int]]:
    """The document and the line of each of its keys; raises yaml.YAMLError, RecursionError."""
    loader = _UniqueKeyLoader(text)  # a SafeLoader
    try:
        node = loader.get_single_node()
        if node is None:
            return None, {}
        return loader.construct_document(node), _key_lines(node)
    finally:
        loader.dispose()


def parse(text: str, source: str, environ: dict[str, str] | None = None) -> Config:
    """Parse and validate configuration text; `source` names it in errors. Raises ConfigError
    with every problem pydantic finds."""
    try:
        raw, lines = _read_yaml(text)
    except _DuplicateKey as exc:
        raise ConfigError(f"{source}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{source}: not valid YAML: nested too deeply") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    overridden = _env_overrides(raw, dict(os.environ) if environ is None else environ)
    try:
        config = Config.model_validate(raw)
    except ValidationError as exc:
        problems = [p for e in exc.errors() for p in _problems(e, source, lines, overridden)]
        raise ConfigError(*problems) from None
    # The folder as named, not resolved: a ConfigMap's file is a symlink into a versioned folder.
    base = Path(os.path.abspath(source)).parent
    return config.model_copy(update={"pools": [_resolve_paths(p, base) for p in config.pools]})


def _resolve_paths(pool: Pool, base: Path) -> Pool:
    """Tokenizer and template paths are relative to the configuration file."""
    update: dict[str, str] = {"tokenizer": str(base / pool.tokenizer)}
    if pool.chat_template:
        update["chat_template"] = str(base / pool.chat_template)
    return pool.model_copy(update=update)


def load(path: str | Path, environ: dict[str, str] | None = None) -> Config:
    """Read and validate the configuration file at `path`."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        byte = exc.object[exc.start]
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {byte:#04x} at offset {exc.start})"
        ) from None
    return parse(text, str(path), environ)
