"""The Lua scripts of the Redis ledger, and the keys they take.

Each script is package data (kvguard/ledger/lua/NAME.lua), expanded with its `--#include` lines
(lib.lua) and named by its SHA1 for EVALSHA; every key of a pool is hash-tagged `{pool}`, so a
script's keys share one Redis Cluster slot.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import re
from dataclasses import dataclass

_INCLUDE = re.compile(r"^--#include (\S+)$", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Script:
    name: str
    source: str  # with lib.lua included
    sha: str  # SHA1 of `source`, as EVALSHA names it


def load_script(name: str) -> Script:
    """Read kvguard/ledger/lua/NAME.lua (package data) and expand its `--#include` lines."""
    folder = importlib.resources.files("kvguard.ledger").joinpath("lua")

    def include(match: re.Match[str]) -> str:
        return folder.joinpath(match.group(1)).read_text(encoding="utf-8")

    source = _INCLUDE.sub(include, folder.joinpath(f"{name}.lua").read_text(encoding="utf-8"))
    return Script(name, source, hashlib.sha1(source.encode()).hexdigest())


SCRIPT_NAMES = ("reserve", "release", "renew", "reassert", "usage", "leases", "replicas")
# Every kvguard process sharing this Redis registers here (replicas.lua), whatever its pools.
REPLICAS_KEY = "kvguard:replicas"


def pool_keys(pool: str) -> list[str]:
    """KEYS[1..5] of the scripts for `pool`: leases, expiries, tenants, reserved, epoch
    (lib.lua)."""
    tag = f"kvguard:{{{pool}}}"
    return [f"{tag}:leases", f"{tag}:expiries", f"{tag}:tenants", f"{tag}:reserved", f"{tag}:epoch"]


def promise_keys(pool: str) -> list[str]:
    """KEYS[6..15], after `pool_keys`: promises, promise lines, promise sequence, promise
    expiries, promised, promised tenants, holding, holding tenants, unreturned, promise budgets
    (lib.lua)."""
    tag = f"kvguard:{{{pool}}}"
    names = (
        "promises",
        "promise-lines",
        "promise-seq",
        "promise-expiries",
        "promised",
        "promised-tenants",
        "holding",
        "holding-tenants",
        "unreturned",
        "promise-budgets",
    )
    return [f"{tag}:{name}" for name in names]


def end_keys(pool: str) -> list[str]:
    """KEYS[16..17], after `promise_keys`: the leases' expected ends, the pool's and each
    tenant's (lib.lua)."""
    tag = f"kvguard:{{{pool}}}"
    return [f"{tag}:ends", f"{tag}:tenant-ends"]


def all_keys(pool: str) -> list[str]:
    """The KEYS of every script for `pool` (lib.lua)."""
    return [*pool_keys(pool), *promise_keys(pool), *end_keys(pool)]
