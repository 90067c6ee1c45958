"""What kvguard adds to a request, measured through the real Envoy (a benchmark, not a test).

Two Envoys from envoy/envoy.yaml in the same run: one with its ext_proc filters removed (bare),
one with kvguard (`kvguard serve`, its own process, memory ledger; `--ledger redis`: a
redis-server of its own on loopback, as replicas sharing a pool use) in front of the same local
upstream. Load comes from a separate process; kvguard's CPU time comes from /proc. Both ends
are lean (bench/http_load.py: an HTTP/1.1 client on raw asyncio protocols, and an upstream that
answers every request at once), so that they take little of the CPU Envoy runs on; each load
reports its own CPU per request.

Chat prompts are calibrated to exactly 100, 1k, 8k and 32k Qwen prompt tokens as kvguard counts
them. Two workloads:
- `unique`: every request's text differs (a request number leads the message), so nothing
  kvguard has counted before helps;
- `history`: a multi-turn chat: a shared system prompt and earlier turns make up ~90 % of the
  prompt, and only the last user message is new (what chat traffic mostly looks like).

Per prompt size and workload it prints and writes to bench-results/overhead.json (with the
host's speed, the seconds `sum(range(10**8))` takes):
1. capacity: closed loop (CONCURRENCY streams, back to back) through Envoy + kvguard: requests/s
   and the admissions one kvguard core sustains (requests / kvguard CPU seconds);
2. added latency at 30 % and 60 % of that capacity (open loop: arrivals do not wait for
   answers): p50/p99/p99.9 bare and guarded, and their difference;
3. decision latency of 8k and 32k-token prompts alone (4 requests/s), against bare;
4. saturation with 32k-token prompts mixed in (one request in 20, closed loop): Envoy's message
   timeouts (504) must stay at 0; busy refusals (503 with retry-after) are counted apart;
5. the floor under kvguard's CPU: bench/noop_extproc.py (grpc.aio alone, every message answered
   at once) in kvguard's place, at each capacity point's request rate. What grpc.aio costs per
   request depends on the rate (the fewer requests, the fewer events each wake-up serves), so
   it is measured at the rate kvguard sustained, not at the no-op's own capacity;
6. the floor under kvguard's added latency: the no-op at each latency point's rate and bodies,
   against the bare Envoy measured there: what the gRPC round trips alone add;
7. what parsing a body costs (in this process, no Envoy): kvguard.tokens.request.load_json, which
   refuses a key repeated in any object, against plain json.loads, on the same bodies, in µs.
   `--parse-only` measures only this;
8. streamed answers, through a second pair of Envoys from the same file (bare and guarded) in
   front of kvguard.testing.streaming_upstream.StreamingUpstream: one SSE event (a
   chat.completion.chunk) per token, `--token-gap-ms` apart (5), `--stream-tokens` per answer
   (200), to 1k-token prompts at fixed rates (open loop, bench/sse_load.py timing each event
   as it is read): time to first token and the gaps between tokens, bare and guarded, and
   kvguard's CPU per stream against the same requests not streamed. Whatever envoy/envoy.yaml
   and kvguard's defaults turn on for responses is measured; `--response-sample SHARE` sets the
   share of responses kvguard reads (server.response_sample; 1.0: every one, the worst case).
   `--streaming-only` measures only this and writes bench-results/overhead-streaming.json.

kvguard runs as a default install does: Prometheus metrics on, a JSON log line per decision
(written to a file). Each point records how busy kvguard's CPU and the others were.

kvguard runs with jemalloc preloaded, as the image runs it, when the library is installed
(Debian: libjemalloc2); `--allocator system` measures glibc's malloc instead. kvguard gets
one CPU of its own (a sidecar with a CPU request of 1) and Envoy, the upstream and the load the
others, so that the load's own CPU does not queue kvguard's work; `--share-cpus` lets every
process run on every CPU. `--processor noop` puts bench/noop_extproc.py (every message answered
CONTINUE at once) in kvguard's place: the floor grpc.aio sets under kvguard's figures.

`--body-mode streamed` configures the guarded Envoys' ext_proc as the Gateway API Inference
Extension's gateways do (FULL_DUPLEX_STREAMED bodies both ways, the response headers and
trailers sent); `--lb round_robin` gives the vllm cluster Envoy's default round robin instead of
the shipped override_host policy.

    .venv/bin/python bench/bench_overhead.py [--quick] [--allocator jemalloc|system]
        [--share-cpus] [--processor kvguard|noop] [--ledger memory|redis]
        [--load-client http1|aiohttp] [--parse-only] [--stream-tokens N] [--token-gap-ms MS]
        [--response-sample SHARE] [--streaming-only] [--body-mode buffered|streamed]
        [--lb override_host|round_robin]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes.util
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import timeit
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import uvloop
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.http_load import Http1Client, LeanUpstream, at_rate  # noqa: E402
from kvguard.config.schema import Config  # noqa: E402
from kvguard.ops import grpc_io  # noqa: E402
from kvguard.testing import free_port  # noqa: E402
from kvguard.testing.envoy import (  # noqa: E402
    EXT_PROC_FILTER,
    UPSTREAM_CLUSTER,
    EnvoyProcess,
    cluster,
    http_filters,
    loopback_config,
    streamed_bodies,
    without_http_filter,
)
from kvguard.testing.redis import RedisServer  # noqa: E402
from kvguard.testing.streaming_upstream import StreamingUpstream  # noqa: E402
from kvguard.tokens.request import load_json  # noqa: E402
from kvguard.tokens.tokenizer import PoolTokenizer  # noqa: E402

TOKENIZER = ROOT / ".cache" / "models" / "qwen"
# Prompt vocabulary: the words of the docs, so that prompts differ from each other.
WORDS = " ".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))).split()
TICKS = os.sysconf("SC_CLK_TCK")
JEMALLOC = ctypes.util.find_library("jemalloc")
CONCURRENCY = 16
LOAD_SHARES = (0.3, 0.6)  # the fractions of measured capacity at which latency is measured
NONCE = "00000000"  # replaced by the request number: 8 digits, 8 tokens, whatever the number
HISTORY_SHARE = 0.9  # of a `history` prompt's tokens, the part earlier requests already sent
MIX_EVERY = 20  # saturation mix: one request in this many carries a 32k-token prompt
Post = Callable[[bytes, int], Awaitable[int]]  # post(body, i) -> HTTP status
LOAD_CLIENT = "http1"  # the load processes' HTTP client (--load-client)
BODY_MODE = "buffered"  # the guarded Envoys' ext_proc body mode (--body-mode)
UPSTREAM_LB = "override_host"  # the vllm cluster's load balancing (--lb)
STREAM_RATES = {True: (20,), False: (20, 50)}  # streams/s, with --quick and without
# The key (a path into the configuration) of the share of guarded exchanges whose response
# kvguard reads; --response-sample sets it where the schema has it.
RESPONSE_SAMPLE_KEY = ("server", "response_sample")


@dataclass(frozen=True)
class Streams:
    """The streamed answers' part: `tokens` per answer, `gap_s` between tokens, the share of
    responses kvguard reads (None: its default), and whether to run this part alone."""

    tokens: int = 200
    gap_s: float = 0.005
    sample: float | None = None
    only: bool = False


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def cpu_ticks() -> dict[int, tuple[int, int]]:
    """Per CPU: (idle + iowait ticks, all ticks), from /proc/stat."""
    ticks = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *values = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            v = [int(x) for x in values[:8]]
            ticks[int(name[3:])] = (v[3] + v[4], sum(v))
    return ticks


def busy_percent(
    before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]], cpus: set[int]
) -> float:
    idle = sum(after[c][0] - before[c][0] for c in cpus)
    total = sum(after[c][1] - before[c][1] for c in cpus)
    return round(100.0 * (1 - idle / total), 1) if total else float("nan")


def _text(words: int, start: int) -> str:
    return " ".join(WORDS[(start + k) % len(WORDS)] for k in range(words))


def _chat(system: str, turns: list[str], last: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}]
    for k, turn in enumerate(turns):
        messages.append({"role": "user" if k % 2 == 0 else "assistant", "content": turn})
    messages.append({"role": "user", "content": f"{NONCE} {last}"})
    return {"model": "qwen", "max_tokens": 16, "messages": messages}


def calibrated_body(tokenizer: PoolTokenizer, tokens: int, workload: str) -> dict[str, Any]:
    """A chat body of exactly `tokens` prompt tokens (as kvguard and vLLM count them), with
    NONCE where the request number goes. `history`: the last user message holds only
    1 - HISTORY_SHARE of the tokens; the system prompt and four earlier turns hold the rest."""

    def body(words: int) -> dict[str, Any]:
        if workload == "unique":
            return _chat("You are a helpful assistant.", [], _text(words, 0))
        new = max(1, int(words * (1 - HISTORY_SHARE)))
        old = (words - new) // 5
        turns = [_text(old, 1000 * (k + 1)) for k in range(4)]
        return _chat(_text(old, 0), turns, _text(new, 7000))

    def count(words: int) -> int:
        return tokenizer.count(tokenizer.chat_prompt(body(words)).text, False)

    low, high = 1, tokens  # at least one token per word
    while low < high:  # the most words whose prompt stays within `tokens`
        mid = (low + high + 1) // 2
        low, high = (mid, high) if count(mid) <= tokens else (low, mid - 1)
    chat = body(low)
    short = tokens - count(low)  # pad the new message with single-token words
    chat["messages"][-1]["content"] += " a" * short
    assert count_body(tokenizer, chat) == tokens, (tokens, count_body(tokenizer, chat))
    return chat


def count_body(tokenizer: PoolTokenizer, chat: dict[str, Any]) -> int:
    return tokenizer.count(tokenizer.chat_prompt(chat).text, False)


class Bodies:
    """Request i's body: the calibrated body with a number in place of NONCE, unique across the
    whole run (each load process gets its own range), so `unique` text is never seen twice."""

    def __init__(self, chat: dict[str, Any], first: int = 0) -> None:
        prefix, suffix = json.dumps(chat).split(NONCE)
        self._prefix, self._suffix, self._first = prefix.encode(), suffix.encode(), first

    def __call__(self, i: int) -> bytes:
        return b"%s%08d%s" % (self._prefix, (self._first + i) % 10**8, self._suffix)

    def spec(self, first: int) -> list[Any]:
        return [self._prefix.decode(), self._suffix.decode(), first]

    @classmethod
    def from_spec(cls, spec: list[Any]) -> Bodies:
        bodies = cls.__new__(cls)
        bodies._prefix, bodies._suffix = spec[0].encode(), spec[1].encode()
        bodies._first = spec[2]
        return bodies


def _summary(latencies: list[float], statuses: Counter[int], seconds: float) -> dict[str, Any]:
    latencies.sort()

    def pct(q: float) -> float:
        if not latencies:
            return float("nan")
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000

    return {
        "requests": len(latencies),
        "per_s": len(latencies) / seconds,
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "p999_ms": pct(0.999),
    }


def _per_request_ms(seconds: float, requests: int) -> float:
    """The load process's own CPU per request: what it takes from the CPUs Envoy runs on."""
    return seconds * 1000 / requests if requests else float("nan")


def _headers(i: int) -> dict[str, str]:
    return {"content-type": "application/json", "x-tenant-id": f"t{i % 8}"}


def _added(guarded: dict[str, Any], bare: dict[str, Any]) -> dict[str, float]:
    """added_p50_ms, added_p99_ms, added_p999_ms: guarded minus bare."""
    return {f"added_{q}_ms": guarded[f"{q}_ms"] - bare[f"{q}_ms"] for q in ("p50", "p99", "p999")}


@contextlib.asynccontextmanager
async def _poster(url: str, load_client: str) -> AsyncIterator[Post]:
    """post(body, i) -> status, to url's chat endpoint; request i's tenant is t{i % 8}.
    `http1`: bench/http_load.py's lean client; `aiohttp`: aiohttp's, as earlier runs used."""
    if load_client == "http1":
        lean = Http1Client(url)

        async def post_http1(body: bytes, i: int) -> int:
            return await lean.post("/v1/chat/completions", body, _headers(i))

        try:
            yield post_http1
        finally:
            lean.close()
        return
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def post_aiohttp(body: bytes, i: int) -> int:
            async with http.post(
                url + "/v1/chat/completions",
                data=body,
                headers=_headers(i),
            ) as response:
                await response.read()
                return response.status

        yield post_aiohttp


async def open_loop(
    url: str, bodies: Bodies, rate: float, seconds: float, load_client: str = "http1"
) -> dict[str, Any]:
    """Request i starts at i / rate, whatever happened to the others."""
    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    async with _poster(url, load_client) as post:

        async def one(i: int) -> None:
            start = time.perf_counter()
            statuses[await post(bodies(i), i)] += 1
            latencies.append(time.perf_counter() - start)

        cpu0 = time.process_time()
        await at_rate(rate, seconds, one)
    result = _summary(latencies, statuses, seconds)
    cpu = time.process_time() - cpu0
    result["client_cpu_ms_per_request"] = _per_request_ms(cpu, len(latencies))
    return result


async def closed_loop(
    url: str,
    bodies: Bodies,
    seconds: float,
    large: Bodies | None = None,
    load_client: str = "http1",
) -> dict[str, Any]:
    """CONCURRENCY streams send back to back for `seconds`; with `large`, request i uses it
    when i % MIX_EVERY == 0 (reported apart as "large")."""
    kinds: dict[str, tuple[list[float], Counter[int]]] = {
        "small": ([], Counter()),
        "large": ([], Counter()),
    }
    counter = iter(range(10**9))
    async with _poster(url, load_client) as post:
        deadline = time.perf_counter() + seconds

        async def stream() -> None:
            while time.perf_counter() < deadline:
                i = next(counter)
                is_large = large is not None and i % MIX_EVERY == 0
                latencies, statuses = kinds["large" if is_large else "small"]
                start = time.perf_counter()
                statuses[await post((large if is_large else bodies)(i), i)] += 1
                latencies.append(time.perf_counter() - start)

        t0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(stream() for _ in range(CONCURRENCY)))
        elapsed = time.perf_counter() - t0
    result = _summary(*kinds["small"], elapsed)
    requests = sum(len(latencies) for latencies, _ in kinds.values())
    result["client_cpu_ms_per_request"] = _per_request_ms(time.process_time() - cpu0, requests)
    if large is not None:
        result["large"] = _summary(*kinds["large"], elapsed)
    return result


_FIRST_NUMBERS = itertools.count(0, 10**6)  # a load process sends fewer requests than this


def in_subprocess(call: str, *args: Any) -> dict[str, Any]:
    """Run open_loop/closed_loop/stream_loop in its own process, so the client's CPU is not
    kvguard's or Envoy's. Bodies travel as specs."""
    spec = json.dumps([a.spec(next(_FIRST_NUMBERS)) if isinstance(a, Bodies) else a for a in args])
    code = (
        f"import json, sys, uvloop; sys.path.insert(0, {str(ROOT)!r}); "
        "from bench.bench_overhead import Bodies, open_loop, closed_loop; "
        "from bench.sse_load import stream_loop; "
        "args = [Bodies.from_spec(a) if isinstance(a, list) else a "
        "for a in json.loads(sys.stdin.read())]; "
        f"print(json.dumps(uvloop.run({call}(*args, load_client={LOAD_CLIENT!r}))))"
    )
    out = subprocess.run([sys.executable, "-c", code], input=spec, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the load process failed:\n{out.stderr}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def kvguard_config(
    port: int, metrics_port: int, ledger_url: str, response_sample: float | None = None
) -> dict[str, Any]:
    """kvguard's configuration; with `response_sample`, RESPONSE_SAMPLE_KEY set to it where the
    schema has that key."""
    config: dict[str, Any] = {
        "server": {  # the defaults' cost: Prometheus on, a JSON line per decision
            "grpc_listen": f"127.0.0.1:{port}",
            "metrics_listen": f"127.0.0.1:{metrics_port}",
            "log_level": "info",
        },
        "ledger": {"url": ledger_url, "lease_seconds": 60},
        "tenancy": {
            "default_tier": "pro",
            # A cap above the streamed answers' limit, so that no limit is clamped.
            "tiers": {
                "pro": {"max_tokens_cap": 4096, "default_max_tokens": 16, "max_blocks": 10**6}
            },
        },
        "pools": [
            {
                "name": "qwen",
                "models": ["qwen"],
                "tokenizer": str(TOKENIZER),
                "max_model_len": 65536,
                "capacity": {"blocks": 10**7, "block_size": 16},
            }
        ],
    }
    if response_sample is not None and schema_has(RESPONSE_SAMPLE_KEY):
        *parents, leaf = RESPONSE_SAMPLE_KEY
        section = config
        for key in parents:
            section = section.setdefault(key, {})
        section[leaf] = response_sample
    return config


def without_ext_proc(config: dict[str, Any]) -> dict[str, Any]:
    """The bare Envoy's configuration: `config` without its ext_proc filters, kvguard's
    (EXT_PROC_FILTER) and any other that is or wraps one (a filter behind a matcher)."""
    bare = without_http_filter(config, EXT_PROC_FILTER)
    filters = http_filters(bare)
    filters[:] = [f for f in filters if not _holds_ext_proc(f)]
    return bare


def _holds_ext_proc(node: Any) -> bool:
    """Whether an ext_proc filter's configuration is `node` or lies anywhere within it."""
    if isinstance(node, list):
        return any(_holds_ext_proc(item) for item in node)
    if not isinstance(node, dict):
        return False
    kind = node.get("@type")
    if isinstance(kind, str) and kind.endswith(".ext_proc.v3.ExternalProcessor"):
        return True
    return any(_holds_ext_proc(value) for value in node.values())


def schema_has(path: tuple[str, ...]) -> bool:
    """Whether kvguard's configuration schema has the key at `path` (sections, then the key)."""
    model: Any = Config
    for key in path:
        fields = getattr(model, "model_fields", None)
        if not isinstance(fields, dict) or key not in fields:
            return False
        model = fields[key].annotation
    return True


def _ms(x: float) -> str:
    return f"{x:6.2f}"


def parse_cost(tokenizer: PoolTokenizer) -> list[dict[str, Any]]:
    """µs to parse each calibrated body: json.loads alone, and kvguard's load_json (the same
    parse with the repeated-key check), the best of 7 rounds of 20,000 each, taken in turns so
    that both see the host alike."""
    points = []
    for workload in ("unique", "history"):
        for tokens in (100, 1000):
            text = Bodies(calibrated_body(tokenizer, tokens, workload))(0).decode()
            rounds: dict[Callable[[str], Any], list[float]] = {json.loads: [], load_json: []}
            for _ in range(7):
                for parse, times in rounds.items():
                    times.append(timeit.timeit(partial(parse, text), number=20_000) / 20_000)
            plain, checked = (min(times) * 1e6 for times in rounds.values())
            point = {
                "workload": workload,
                "prompt_tokens": tokens,
                "body_bytes": len(text.encode()),
                "json_loads_us": round(plain, 2),
                "load_json_us": round(checked, 2),
            }
            points.append(point)
            print(
                f"{workload:>7} {tokens:>5} tok parse ({point['body_bytes']} bytes): json.loads "
                f"{plain:5.2f} µs, with the repeated-key check {checked:5.2f} µs "
                f"({checked - plain:+.2f})",
                flush=True,
            )
    return points


async def run(
    quick: bool,
    bare_url: str,
    guarded_url: str,
    kvguard_pid: int,
    cpu_groups: dict[str, set[int]],
    metrics_url: str,
) -> tuple[dict[str, Any], dict[tuple[str, int], Bodies]]:
    """The measurements with kvguard in place; also the bodies of each capacity point."""
    seconds = _seconds(quick)
    tokenizer = PoolTokenizer.load(TOKENIZER)
    capacity_bodies: dict[tuple[str, int], Bodies] = {}
    results: dict[str, Any] = {
        "seconds_per_point": seconds,
        "concurrency": CONCURRENCY,
        "cpus": os.cpu_count(),
        "capacity": [],
        "latency": [],
        "large": [],
        "saturation_mix": {},
        "parse": parse_cost(tokenizer),
    }

    async def measured(call: str, *args: Any) -> tuple[dict[str, Any], float]:
        return await _measured(kvguard_pid, cpu_groups, call, *args, metrics=metrics_url)

    for workload in ("unique", "history"):
        for tokens in (100, 1000):
            bodies = Bodies(calibrated_body(tokenizer, tokens, workload))
            capacity_bodies[workload, tokens] = bodies
            await _client("closed_loop", guarded_url, bodies, 1.0)
            sat, cpu = await measured("closed_loop", guarded_url, bodies, seconds)
            per_core = sat["requests"] / cpu
            results["capacity"].append(
                {
                    "workload": workload,
                    "prompt_tokens": tokens,
                    "closed_loop": sat,
                    "kvguard_cpu_ms_per_request": cpu * 1000 / sat["requests"],
                    "admissions_per_core_s": per_core,
                }
            )
            print(
                f"{workload:>7} {tokens:>5} tok capacity: {sat['per_s']:6.0f} req/s "
                f"(p50 {_ms(sat['p50_ms'])} ms) | kvguard {cpu * 1000 / sat['requests']:.3f} "
                f"ms CPU/req = {per_core:5.0f} admissions/s/core | {sat['statuses']} | "
                f"busy % {sat['busy_percent']}",
                flush=True,
            )
            for share in LOAD_SHARES:
                rate = round(share * sat["per_s"])
                bare = await _client("open_loop", bare_url, bodies, rate, seconds)
                guarded, cpu = await measured("open_loop", guarded_url, bodies, rate, seconds)
                point = {
                    "workload": workload,
                    "prompt_tokens": tokens,
                    "load_share": share,
                    "rate": rate,
                    "bare": bare,
                    "guarded": guarded,
                    **_added(guarded, bare),
                    "kvguard_cpu_ms_per_request": cpu * 1000 / guarded["requests"],
                }
                results["latency"].append(point)
                print(
                    f"{workload:>7} {tokens:>5} tok {rate:>5} req/s ({share:.0%}): bare p50 "
                    f"{_ms(bare['p50_ms'])} p99 {_ms(bare['p99_ms'])} | guarded p50 "
                    f"{_ms(guarded['p50_ms'])} p99 {_ms(guarded['p99_ms'])} p99.9 "
                    f"{_ms(guarded['p999_ms'])} | added p50 {_ms(point['added_p50_ms'])} p99 "
                    f"{_ms(point['added_p99_ms'])} p99.9 {_ms(point['added_p999_ms'])} ms | "
                    f"{guarded['statuses']} | kvguard {point['kvguard_cpu_ms_per_request']:.3f} ms "
                    f"CPU/req, decides p50/p99 <= {_bucket(guarded, 'p50')}/"
                    f"{_bucket(guarded, 'p99')} ms | busy % {guarded['busy_percent']}",
                    flush=True,
                )
    large_bodies = {}
    for tokens in (8000, 32000):
        bodies = large_bodies[tokens] = Bodies(calibrated_body(tokenizer, tokens, "unique"))
        bare = await _client("open_loop", bare_url, bodies, 4.0, seconds)
        guarded = await _client("open_loop", guarded_url, bodies, 4.0, seconds)
        added = _added(guarded, bare)
        results["large"].append(
            {"prompt_tokens": tokens, "rate": 4.0, "bare": bare, "guarded": guarded, **added}
        )
        print(
            f"unique {tokens:>6} tok     4 req/s: guarded p50 {_ms(guarded['p50_ms'])} p99 "
            f"{_ms(guarded['p99_ms'])} | added p50 {_ms(added['added_p50_ms'])} p99 "
            f"{_ms(added['added_p99_ms'])} ms | "
            f"{guarded['statuses']}",
            flush=True,
        )
    small = Bodies(calibrated_body(tokenizer, 1000, "unique"))
    mix = await _client("closed_loop", guarded_url, small, seconds, large_bodies[32000])
    results["saturation_mix"] = mix
    timeouts = mix["statuses"].get("504", 0) + mix["large"]["statuses"].get("504", 0)
    print(
        f"saturation, 1k-token prompts with one 32k in {MIX_EVERY}: {mix['per_s']:.0f} req/s | "
        f"1k p50 {_ms(mix['p50_ms'])} p99 {_ms(mix['p99_ms'])} {mix['statuses']} | 32k p50 "
        f"{_ms(mix['large']['p50_ms'])} p99 {_ms(mix['large']['p99_ms'])} "
        f"{mix['large']['statuses']} | message timeouts (504): {timeouts}",
        flush=True,
    )
    return results, capacity_bodies


async def floor(
    quick: bool,
    guarded_url: str,
    noop_pid: int,
    cpu_groups: dict[str, set[int]],
    capacity: list[dict[str, Any]],
    bodies: dict[tuple[str, int], Bodies],
) -> list[dict[str, Any]]:
    """The no-op processor's CPU per request at each capacity point's rate (open loop), and
    what kvguard spent beyond it."""
    points = []
    first = capacity[0]
    warm = bodies[first["workload"], first["prompt_tokens"]]
    await _client("closed_loop", guarded_url, warm, 1.0)  # connections open
    for point in capacity:
        key = point["workload"], point["prompt_tokens"]
        rate = round(point["closed_loop"]["per_s"])
        result, cpu = await _measured(
            noop_pid,
            cpu_groups,
            "open_loop",
            guarded_url,
            bodies[key],
            rate,
            _seconds(quick),
        )
        floor_ms = cpu * 1000 / result["requests"]
        own_ms = point["kvguard_cpu_ms_per_request"] - floor_ms
        points.append(
            {
                "workload": key[0],
                "prompt_tokens": key[1],
                "rate": rate,
                "noop": result,
                "noop_cpu_ms_per_request": floor_ms,
                "kvguard_beyond_floor_ms": own_ms,
            }
        )
        print(
            f"{key[0]:>7} {key[1]:>5} tok {rate:>5} req/s: grpc.aio no-op {floor_ms:.3f} ms "
            f"CPU/req; kvguard beyond it {own_ms:.3f} ms | {result['statuses']}",
            flush=True,
        )
    return points


async def floor_latency(
    quick: bool,
    guarded_url: str,
    latency: list[dict[str, Any]],
    bodies: dict[tuple[str, int], Bodies],
) -> list[dict[str, Any]]:
    """What the no-op processor adds to the latency at each of kvguard's latency points (same
    bodies, same rate), against the bare Envoy measured there: the part of kvguard's added
    latency that the gRPC round trips alone cost."""
    points = []
    for point in latency:
        key = point["workload"], point["prompt_tokens"]
        noop = await _client("open_loop", guarded_url, bodies[key], point["rate"], _seconds(quick))
        added = _added(noop, point["bare"])
        points.append(
            {
                "workload": key[0],
                "prompt_tokens": key[1],
                "load_share": point["load_share"],
                "rate": point["rate"],
                "noop": noop,
                **added,
            }
        )
        print(
            f"{key[0]:>7} {key[1]:>5} tok {point['rate']:>5} req/s "
            f"({point['load_share']:.0%}): grpc.aio no-op adds p50 {_ms(added['added_p50_ms'])} "
            f"p99 {_ms(added['added_p99_ms'])} p99.9 {_ms(added['added_p999_ms'])} ms (kvguard: "
            f"{_ms(point['added_p50_ms'])} / {_ms(point['added_p99_ms'])} / "
            f"{_ms(point['added_p999_ms'])}) | {noop['statuses']}",
            flush=True,
        )
    return points


async def streaming(
    quick: bool,
    bare_url: str,
    guarded_url: str,
    kvguard_pid: int,
    cpu_groups: dict[str, set[int]],
    metrics_url: str,
    streams: Streams,
) -> list[dict[str, Any]]:
    """Streamed answers (bench/sse_load.py against StreamingUpstream: one SSE event per token,
    `streams.gap_s` apart) to 1k-token prompts of new text, at each STREAM_RATES rate (open
    loop), bare then guarded: time to first token, the gaps between tokens as the client reads
    them, and kvguard's CPU per stream, whole (its gRPC stream lasts until the answer ends);
    then the same requests not streamed (one body of the same answer), at the same rate
    through the same Envoy: kvguard's CPU per request that streaming is compared with."""
    seconds = _seconds(quick)
    chat = calibrated_body(PoolTokenizer.load(TOKENIZER), 1000, "unique")
    # Answers end before their limit (finish_reason stop), as most real answers do.
    bodies = Bodies(chat | {"stream": True, "max_tokens": 2 * streams.tokens})
    whole = Bodies(chat | {"stream": False, "max_tokens": 2 * streams.tokens})
    for url in (bare_url, guarded_url):  # connections open, kvguard's first decisions made
        await _client("stream_loop", url, bodies, 5.0, 1.0)
    points = []
    for rate in STREAM_RATES[quick]:
        bare, _ = await _measured(
            kvguard_pid, cpu_groups, "stream_loop", bare_url, bodies, rate, seconds
        )
        guarded, cpu = await _measured(
            kvguard_pid,
            cpu_groups,
            "stream_loop",
            guarded_url,
            bodies,
            rate,
            seconds,
            metrics=metrics_url,
        )
        not_streamed, whole_cpu = await _measured(
            kvguard_pid, cpu_groups, "open_loop", guarded_url, whole, rate, seconds
        )
        added = {
            f"added_{name}_ms": guarded[f"{name}_ms"] - bare[f"{name}_ms"]
            for name in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "itl_p999")
        }
        ratios = {
            f"{name}_ratio": _ratio(guarded[f"{name}_ms"], bare[f"{name}_ms"])
            for name in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "stream_p50")
        }
        point = {
            "prompt_tokens": 1000,
            "answer_tokens": streams.tokens,
            "token_gap_ms": streams.gap_s * 1000,
            "rate": rate,
            "bare": bare,
            "guarded": guarded,
            **added,
            **ratios,
            "not_streamed": not_streamed,
            "kvguard_cpu_ms_per_stream": cpu * 1000 / guarded["streams"],
            "kvguard_cpu_ms_per_request_not_streamed": whole_cpu * 1000 / not_streamed["requests"],
        }
        point["kvguard_cpu_stream_ratio"] = _ratio(
            point["kvguard_cpu_ms_per_stream"], point["kvguard_cpu_ms_per_request_not_streamed"]
        )
        points.append(point)
        print(
            f"streamed {streams.tokens} tokens {streams.gap_s * 1000:g} ms apart, {rate} "
            f"streams/s: TTFT p50/p99 bare {_ms(bare['ttft_p50_ms'])} / {_ms(bare['ttft_p99_ms'])}"
            f" guarded {_ms(guarded['ttft_p50_ms'])} / {_ms(guarded['ttft_p99_ms'])} ms | "
            f"inter-token p50/p99 bare {_ms(bare['itl_p50_ms'])} / {_ms(bare['itl_p99_ms'])} "
            f"guarded {_ms(guarded['itl_p50_ms'])} / {_ms(guarded['itl_p99_ms'])} ms "
            f"(x{point['itl_p99_ratio']:.3f} at p99) | added TTFT p50/p99 "
            f"{_ms(added['added_ttft_p50_ms'])} / {_ms(added['added_ttft_p99_ms'])} ms | "
            f"kvguard {point['kvguard_cpu_ms_per_stream']:.3f} ms CPU/stream, "
            f"{point['kvguard_cpu_ms_per_request_not_streamed']:.3f} not streamed "
            f"(x{point['kvguard_cpu_stream_ratio']:.2f}) | "
            f"{guarded['statuses']}, events/stream {guarded['events_per_stream']}, unfinished "
            f"{bare['unfinished']}/{guarded['unfinished']} | busy % {guarded['busy_percent']}",
            flush=True,
        )
    return points


def _ratio(guarded: float, bare: float) -> float:
    return guarded / bare if bare else float("nan")


def config_note(sample: float | None) -> str:
    """What --response-sample did to kvguard's configuration, in words."""
    key = ".".join(RESPONSE_SAMPLE_KEY)
    if not schema_has(RESPONSE_SAMPLE_KEY):
        return f"--response-sample not applied: the schema has no {key}"
    if sample is None:
        return f"{key}: the default ({_default(RESPONSE_SAMPLE_KEY)})"
    return f"{key}: {sample:g}"


def _default(path: tuple[str, ...]) -> Any:
    """The schema's default for the key at `path` (which schema_has found)."""
    model: Any = Config
    for key in path[:-1]:
        model = model.model_fields[key].annotation
    return model.model_fields[path[-1]].default


def host_speed() -> float:
    """Seconds this host takes for sum(range(10**8)): the figures' yardstick across days."""
    start = time.perf_counter()
    sum(range(10**8))
    return round(time.perf_counter() - start, 2)


def _bucket(result: dict[str, Any], quantile: str) -> str:
    return f"{result.get(f'decision_{quantile}_at_most_ms', float('nan')):g}"


def _seconds(quick: bool) -> float:
    return 5.0 if quick else 15.0


async def _client(call: str, *args: Any) -> dict[str, Any]:
    return await asyncio.to_thread(in_subprocess, call, *args)


async def _measured(
    pid: int,
    cpu_groups: dict[str, set[int]],
    call: str,
    *args: Any,
    metrics: str = "",
) -> tuple[dict[str, Any], float]:
    """The load's result (with how busy each CPU group was) and process `pid`'s CPU seconds;
    with `metrics` (kvguard's Prometheus URL), the bucket of kvguard's own decision time that
    holds the p50 and the p99 of this load's decisions."""
    buckets0 = await asyncio.to_thread(decision_buckets, metrics) if metrics else {}
    cpu0, ticks0 = cpu_seconds(pid), cpu_ticks()
    result = await _client(call, *args)
    cpu, ticks = cpu_seconds(pid) - cpu0, cpu_ticks()
    result["busy_percent"] = {
        group: busy_percent(ticks0, ticks, cpus) for group, cpus in cpu_groups.items()
    }
    if metrics:
        buckets = await asyncio.to_thread(decision_buckets, metrics)
        result["decision_p50_at_most_ms"] = bucket_quantile(buckets0, buckets, 0.50)
        result["decision_p99_at_most_ms"] = bucket_quantile(buckets0, buckets, 0.99)
    return result, cpu


def decision_buckets(metrics_url: str) -> dict[float, float]:
    """kvguard_decision_duration_seconds: cumulative count per bucket bound (seconds)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    counts: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "kvguard_decision_duration_seconds":
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    bound = float(sample.labels["le"])
                    counts[bound] = counts.get(bound, 0.0) + sample.value
    return counts


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The upper bound (ms) of the histogram bucket that holds quantile `q` of the decisions
    counted between two scrapes (inf past the last finite bound; nan without decisions)."""
    cumulative = sorted((bound, after[bound] - before.get(bound, 0.0)) for bound in after)
    if not cumulative or cumulative[-1][1] == 0:
        return float("nan")
    total = cumulative[-1][1]
    return next(bound * 1000 for bound, count in cumulative if count >= q * total)


def _cpus(share: bool) -> tuple[set[int] | None, set[int] | None]:
    """(kvguard's CPUs, everyone else's): kvguard gets one CPU, as a sidecar with a CPU of
    its own would, and Envoy, the upstream and the load share the rest; (None, None) with
    `share` or a single CPU: every process runs anywhere."""
    cpus = sorted(os.sched_getaffinity(0))
    if share or len(cpus) < 2:
        return None, None
    return {cpus[-1]}, set(cpus[:-1])


def as_configured(config: dict[str, Any]) -> dict[str, Any]:
    """The shipped configuration with --body-mode and --lb applied."""
    if UPSTREAM_LB == "round_robin":
        cluster(config, UPSTREAM_CLUSTER).pop("load_balancing_policy")
    return streamed_bodies(config) if BODY_MODE == "streamed" else config


async def main(
    quick: bool,
    allocator: str,
    share_cpus: bool,
    processor: str,
    ledger: str,
    streams: Streams,
) -> None:
    kvguard_cpus, other_cpus = _cpus(share_cpus)
    if other_cpus is not None:
        os.sched_setaffinity(0, other_cpus)  # Envoy, Redis and the load processes inherit it
    work = Path(tempfile.mkdtemp(prefix="kvguard-bench-"))
    with contextlib.ExitStack() as stack:
        ledger_url = "memory://"
        if ledger == "redis":  # on the CPUs Envoy and the load share
            ledger_url = stack.enter_context(RedisServer(work / "redis")).url
        await _bench(
            quick, allocator, processor, ledger_url, work, kvguard_cpus, other_cpus, streams
        )


async def _bench(
    quick: bool,
    allocator: str,
    processor: str,
    ledger_url: str,
    work: Path,
    kvguard_cpus: set[int] | None,
    other_cpus: set[int] | None,
    streams: Streams,
) -> None:
    speed = host_speed()
    cpu_groups = {"all_cpus": set(os.sched_getaffinity(0))}
    if kvguard_cpus is not None and other_cpus is not None:
        cpu_groups = {"kvguard_cpu": kvguard_cpus, "other_cpus": other_cpus}
    upstream = LeanUpstream()
    await upstream.start()
    streaming_upstream = StreamingUpstream(tokens=streams.tokens, token_gap=streams.gap_s)
    await streaming_upstream.start()
    port, metrics_port = free_port(), free_port()
    config = kvguard_config(port, metrics_port, ledger_url, streams.sample)
    (work / "kvguard.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if allocator == "jemalloc":  # as the image runs it (Dockerfile)
        if JEMALLOC is None:
            raise SystemExit("libjemalloc is not installed: use --allocator system")
        env["LD_PRELOAD"] = JEMALLOC
    noop = [sys.executable, str(ROOT / "bench" / "noop_extproc.py"), str(port)]
    command = [sys.executable, "-m", "kvguard", "serve", "--config", str(work / "kvguard.yaml")]

    def start(argv: list[str], log: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            argv,
            stderr=(work / log).open("wb"),
            # The no-op's gRPC does its I/O as kvguard's does (kvguard serve sets its own).
            env={"GRPC_EXPERIMENTS": grpc_io.EXPERIMENTS, **env} if argv == noop else env,
            preexec_fn=None
            if kvguard_cpus is None
            else lambda: os.sched_setaffinity(0, kvguard_cpus),
        )

    processes = [start(noop if processor == "noop" else command, f"{processor}.log")]
    # Two pairs of Envoys from the same shipped file, bare and guarded: one pair in front of the
    # upstream that answers at once, one in front of the streaming one.
    configs = {}
    for name, upstream_port in (("", upstream.port), ("streaming-", streaming_upstream.port)):
        guarded_config = as_configured(loopback_config(port, upstream_port))
        configs[f"{name}guarded"] = guarded_config
        configs[f"{name}bare"] = without_ext_proc(guarded_config)
    for name in configs:
        (work / name).mkdir()
    try:
        async with (
            EnvoyProcess(configs["bare"], work / "bare") as bare,
            EnvoyProcess(configs["guarded"], work / "guarded") as guarded,
            EnvoyProcess(configs["streaming-bare"], work / "streaming-bare") as streaming_bare,
            EnvoyProcess(configs["streaming-guarded"], work / "streaming-guarded") as streamed,
        ):
            await guarded.wait_cluster_healthy("kvguard", timeout=60)
            await streamed.wait_cluster_healthy("kvguard", timeout=60)
            sample = config_note(streams.sample)
            print(
                f"{processor} runs on {allocator} malloc, on CPUs {kvguard_cpus or 'shared'}, "
                f"ledger {ledger_url}; Envoy, upstream and load on {other_cpus or 'all CPUs'}; "
                f"{sample}; sum(range(10**8)) takes {speed} s",
                flush=True,
            )
            metrics_url = (
                f"http://127.0.0.1:{metrics_port}/metrics" if processor == "kvguard" else ""
            )
            results: dict[str, Any] = {}
            bodies: dict[tuple[str, int], Bodies] = {}
            if not streams.only:
                results, bodies = await run(
                    quick,
                    bare.url,
                    guarded.url,
                    processes[0].pid,
                    cpu_groups,
                    metrics_url,
                )
            results["streaming"] = await streaming(
                quick,
                streaming_bare.url,
                streamed.url,
                processes[0].pid,
                cpu_groups,
                metrics_url,
                streams,
            )
            results["response_sample"] = sample
            results["host_sum_range_s"] = speed
            results["allocator"] = allocator
            results["processor"] = processor
            results["ledger"] = ledger_url.partition(":")[0]
            results["load_client"] = LOAD_CLIENT
            results["body_mode"], results["lb"] = BODY_MODE, UPSTREAM_LB
            results["kvguard_cpus"] = sorted(kvguard_cpus) if kvguard_cpus else "shared"
            if processor == "kvguard" and not streams.only:  # the no-op in its place
                processes[0].terminate()
                processes[0].wait(30)
                await guarded.wait_cluster_unhealthy("kvguard", timeout=30)
                processes.append(start(noop, "noop.log"))
                await guarded.wait_cluster_healthy("kvguard", timeout=60)
                results["floor"] = await floor(
                    quick,
                    guarded.url,
                    processes[-1].pid,
                    cpu_groups,
                    results["capacity"],
                    bodies,
                )
                results["floor_latency"] = await floor_latency(
                    quick, guarded.url, results["latency"], bodies
                )
    finally:
        for process in processes:
            process.terminate()
            process.wait(30)
        await upstream.stop()
        await streaming_upstream.stop()
    out = ROOT / "bench-results" / ("overhead-streaming.json" if streams.only else "overhead.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--allocator",
        choices=["jemalloc", "system"],
        default="jemalloc" if JEMALLOC else "system",
        help="kvguard's malloc: jemalloc (preloaded, as in the image) or glibc's",
    )
    parser.add_argument(
        "--share-cpus",
        action="store_true",
        help="let kvguard share every CPU with Envoy and the load (default: one CPU of its own)",
    )
    parser.add_argument(
        "--processor",
        choices=["kvguard", "noop"],
        default="kvguard",
        help="noop: bench/noop_extproc.py in kvguard's place, what grpc.aio alone costs",
    )
    parser.add_argument(
        "--ledger",
        choices=["memory", "redis"],
        default="memory",
        help="redis: a redis-server of its own on loopback, as replicas sharing a pool use",
    )
    parser.add_argument(
        "--parse-only",
        action="store_true",
        help="measure only what parsing a body costs (no Envoy, nothing written)",
    )
    parser.add_argument(
        "--load-client",
        choices=["http1", "aiohttp"],
        default="http1",
        help="the load processes' HTTP client: bench/http_load.py (lean) or aiohttp's",
    )
    parser.add_argument(
        "--stream-tokens",
        type=int,
        default=200,
        help="tokens in each streamed answer, one SSE event each (default 200)",
    )
    parser.add_argument(
        "--token-gap-ms",
        type=float,
        default=5.0,
        help="milliseconds between a streamed answer's tokens (default 5)",
    )
    parser.add_argument(
        "--response-sample",
        type=float,
        metavar="SHARE",
        help=f"set {'.'.join(RESPONSE_SAMPLE_KEY)}, the share of responses kvguard reads "
        "(1.0: every one, the worst case); ignored, and said so, where the schema lacks it",
    )
    parser.add_argument(
        "--streaming-only",
        action="store_true",
        help="measure only the streamed answers (writes bench-results/overhead-streaming.json)",
    )
    parser.add_argument(
        "--body-mode",
        choices=["buffered", "streamed"],
        default="buffered",
        help="the guarded Envoys' ext_proc bodies: buffered (shipped) or FULL_DUPLEX_STREAMED",
    )
    parser.add_argument(
        "--lb",
        choices=["override_host", "round_robin"],
        default="override_host",
        help="the vllm cluster's load balancing: override_host (shipped) or round robin",
    )
    args = parser.parse_args()
    LOAD_CLIENT, BODY_MODE, UPSTREAM_LB = args.load_client, args.body_mode, args.lb
    if args.parse_only:
        parse_cost(PoolTokenizer.load(TOKENIZER))
        raise SystemExit(0)
    if args.stream_tokens < 1 or args.token_gap_ms < 0:
        parser.error("--stream-tokens must be at least 1 and --token-gap-ms at least 0")
    streams = Streams(
        args.stream_tokens, args.token_gap_ms / 1000, args.response_sample, args.streaming_only
    )
    uvloop.run(
        main(args.quick, args.allocator, args.share_cpus, args.processor, args.ledger, streams)
    )
