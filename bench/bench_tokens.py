"""Prompt-token counting: throughput and decision latency (a benchmark, not a test).

For chat prompts of about 100, 1k, 8k and 32k Qwen tokens it prints:
- counting throughput (tokens/s) of `count_prompts` on one thread, for text never counted
  before (`new`) and for the same requests again (`seen`: kvguard.tokens.segments remembers them);
  the prompts are English, Chinese and code (text kvguard.tokens.pretokens counts by pre-tokens),
  and `other` is new text with Korean and Japanese kana in it (what tokenizers alone counts);
- decision latency p50/p99 for text never counted before, alone (one request at a time) and
  concurrent (--concurrency streams in flight, closed loop), measured two ways, both in this
  process:
  `decide`   = Admission.admit (parse, count, clamp, reserve; no gRPC);
  `protocol` = the full ext_proc round trip over real gRPC to the in-process Service, from
               writing the body message to reading its answer (client and server share one
               event loop, so the client's own work is included);
- the worst case of counting by pre-tokens: texts of random letters, whose every pre-token is
  new, counted by kvguard.tokens.pretokens (new, then again) against tokenizers alone;
- a mixed load: the latency of 100, 1k and 3k-token requests, one at a time, while two streams
  keep sending 32k-token prompts, for several inline thresholds
  (kvguard.tokens.counting.INLINE_BODY_BYTES): how the threshold was chosen.
Writes bench-results/tokens.json.

    .venv/bin/python bench/bench_tokens.py [--quick] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import string
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import uvloop
import yaml
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc  # noqa: E402

from kvguard import config as configs  # noqa: E402
from kvguard.admission.admit import AdmissionRequest  # noqa: E402
from kvguard.admission.policy import known  # noqa: E402
from kvguard.admission.record import Decision  # noqa: E402
from kvguard.app import Service  # noqa: E402
from kvguard.errors import Refusal  # noqa: E402
from kvguard.tokens import counting  # noqa: E402
from kvguard.tokens.counting import count_prompts  # noqa: E402
from kvguard.tokens.pretokens import PreTokenCounter  # noqa: E402
from kvguard.tokens.request import parse  # noqa: E402
from kvguard.tokens.tokenizer import PoolTokenizer  # noqa: E402

QWEN = ROOT / ".cache" / "models" / "qwen"
SIZES = {"100": 100, "1k": 1_000, "8k": 8_000, "32k": 32_000}
PROSE = (
    "the quick brown fox jumps over a lazy dog while engineers measure latency across kv cache "
    "blocks tenants quotas admission control vLLM Envoy gRPC stream token budget 数据 中心 模型 "
    "推理 東京 北京 naïve façade 42 3.14 2025 def return print(x) {json: true}"
)
WORDS = PROSE.split()
# Words outside kvguard.tokens.pretokens.DOMAIN: a prompt holding them is counted by
# tokenizers alone.
OTHER_WORDS = [*WORDS, "서울", "トークン"]


def config(tmp: Path) -> Path:
    pool = {
        "name": "qwen",
        "models": ["qwen"],
        "tokenizer": str(QWEN),
        "max_model_len": 40_000,
        "capacity": {"blocks": 10_000_000, "block_size": 16},
    }
    tier = {"max_tokens_cap": 64, "default_max_tokens": 16, "max_blocks": 10_000_000}
    data = {
        "server": {"grpc_listen": "127.0.0.1:0", "metrics_listen": ""},
        "tenancy": {"default_tier": "bench", "tiers": {"bench": tier}},
        "pools": [pool],
    }
    path = tmp / "kvguard.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def bodies(
    tokenizer: PoolTokenizer, tokens: int, count: int, seed: int, words: list[str] = WORDS
) -> list[bytes]:
    """`count` chat bodies whose rendered prompt has about `tokens` Qwen tokens each."""
    rng = random.Random(seed)
    probe = " ".join(rng.choice(words) for _ in range(2000))
    per_word = tokenizer.count(probe, False) / 2000
    out = []
    for _ in range(count):
        text = " ".join(rng.choice(words) for _ in range(max(1, int((tokens - 10) / per_word))))
        out.append(json.dumps({"model": "qwen", "messages": [{"role": "user", "content": text}]}))
    return [b.encode() for b in out]


_NONCES = itertools.count()


def new_text(body: bytes) -> bytes:
    """The body with a number no request had before leading its message: text never counted
    (kvguard.tokens.segments would otherwise remember it from an earlier send)."""
    return body.replace(b'"content": "', b'"content": "%d ' % next(_NONCES), 1)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(
    latencies: list[float], tokens: int, wall: float, refused: Counter[str]
) -> dict[str, Any]:
    return {
        "requests": len(latencies),
        "p50_ms": round(pct(latencies, 0.50) * 1e3, 3),
        "p99_ms": round(pct(latencies, 0.99) * 1e3, 3),
        "tokens_per_s": round(tokens / wall),
        "refused": dict(refused),
    }


def throughput(tokenizer: PoolTokenizer, raw: list[bytes], other: list[bytes]) -> dict[str, Any]:
    """count_prompts on one thread: tokens/s for new text, then for the same text again; and
    for new text of other scripts."""
    out: dict[str, Any] = {}
    for name, batch in (("new", raw), ("seen", raw), ("other_new", other)):
        requests = [parse("chat", b) for b in batch]
        start = time.perf_counter()
        tokens = sum(sum(count_prompts(tokenizer, r)) for r in requests)
        out[f"{name}_tokens_per_s"] = round(tokens / (time.perf_counter() - start))
        if name == "new":
            out["tokens_per_request"] = round(tokens / len(requests))
    out["body_bytes"] = round(statistics.mean(len(b) for b in raw))
    return out


def all_new_pre_tokens(count: int, words: int = 800) -> dict[str, float]:
    """ms per text of random letters (every pre-token new): tokenizers alone, then
    kvguard.tokens.pretokens counting them new (learning each one) and again."""
    tokenizer = Tokenizer.from_file(str(QWEN / "tokenizer.json"))
    counter = PreTokenCounter.for_tokenizer(tokenizer)
    assert counter is not None
    rng = random.Random(5)
    texts = [
        " ".join(
            "".join(rng.choice(string.ascii_letters) for _ in range(rng.randint(3, 10)))
            for _ in range(words)
        )
        for _ in range(count)
    ]

    def ms_per_text(count_one: Callable[[str], object]) -> float:
        start = time.perf_counter()
        for text in texts:
            count_one(text)
        return round((time.perf_counter() - start) * 1e3 / len(texts), 2)

    return {
        "tokenizers_ms": ms_per_text(lambda t: tokenizer.encode_batch_fast([t])),
        "pre_tokens_new_ms": ms_per_text(counter.count),
        "pre_tokens_again_ms": ms_per_text(counter.count),
    }


# One request: its outcome ("admitted" or the refusal code), prompt tokens and decision seconds.
Send = Callable[[bytes], Awaitable[tuple[str, int, float]]]


async def closed_loop(send: Send, raw: list[bytes], concurrency: int) -> dict[str, Any]:
    """`concurrency` workers, each sending the next body when its last one is answered."""
    latencies: list[float] = []
    refused: Counter[str] = Counter()
    queue = list(reversed(raw))
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while queue:
            outcome, counted, seconds = await send(new_text(queue.pop()))
            latencies.append(seconds)
            tokens += counted
            if outcome != "admitted":
                refused[outcome] += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return summary(latencies, tokens, time.perf_counter() - start, refused)


def decide_sender(service: Service) -> Send:
    policy = service.policy
    identity = known(policy.tenancy, "bench")

    async def send(body: bytes) -> tuple[str, int, float]:
        start = time.perf_counter()
        try:
            request = AdmissionRequest(policy, "chat", identity, body, Decision())
            admitted = await service.admission.admit(request)
        except Refusal as refusal:
            return refusal.code.value, 0, time.perf_counter() - start
        elapsed = time.perf_counter() - start
        if admitted.lease is not None:
            await service.ledger.release(admitted.lease)
        return "admitted", admitted.prompt_tokens, elapsed

    return send


def protocol_sender(stub: Any) -> Send:
    header_map = HeaderMap(
        headers=[
            HeaderValue(key=k, raw_value=v.encode())
            for k, v in {":method": "POST", ":path": "/v1/chat/completions"}.items()
        ]
    )
    on_headers = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=header_map))

    async def send(body: bytes) -> tuple[str, int, float]:
        call = stub.Process()
        await call.write(on_headers)
        await call.read()
        start = time.perf_counter()
        await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body)))
        while (answer := await call.read()).WhichOneof("response") is None:
            pass  # an override_message_timeout sent ahead of a slow decision
        elapsed = time.perf_counter() - start
        await call.done_writing()
        await call.read()
        if answer.WhichOneof("response") == "immediate_response":
            return answer.immediate_response.details.removeprefix("kvguard_"), 0, elapsed
        hdrs = answer.request_body.response.header_mutation.set_headers
        tokens = next(int(h.header.raw_value) for h in hdrs if h.header.key.endswith("tokens"))
        return "admitted", tokens, elapsed

    return send


async def mixed(
    send: Send, small: list[bytes], large: list[bytes], large_streams: int
) -> dict[str, Any]:
    """Small requests one after another while `large_streams` 32k-token requests keep coming."""
    stop = asyncio.Event()

    async def background() -> None:
        i = 0
        while not stop.is_set():
            await send(new_text(large[i % len(large)]))
            i += 1

    tasks = [asyncio.create_task(background()) for _ in range(large_streams)]
    try:
        return await closed_loop(send, small, 1)
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def main(quick: bool, concurrency: int) -> None:
    counts = {"100": 300, "1k": 200, "8k": 60, "32k": 30}
    if quick:
        counts = {k: max(10, v // 5) for k, v in counts.items()}
    results: dict[str, Any] = {
        "decision": "decide = Admission.admit in process; protocol = full ext_proc round trip "
        "over real gRPC to the in-process Service (client on the same event loop)",
        "inline_body_bytes": counting.INLINE_BODY_BYTES,
        "concurrency": concurrency,
        "sizes": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        service = Service(configs.load(config(Path(tmp)), environ={}))
        await service.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc.port}")
        stub = pb_grpc.ExternalProcessorStub(channel)
        tokenizer = service.policy.pools["qwen"].tokenizer
        senders = {"decide": decide_sender(service), "protocol": protocol_sender(stub)}
        try:
            for size, tokens in SIZES.items():
                raw = bodies(tokenizer, tokens, counts[size], seed=tokens)
                other = bodies(tokenizer, tokens, counts[size], tokens + 1, OTHER_WORDS)
                row: dict[str, Any] = {"count": throughput(tokenizer, raw, other)}
                for way, send in senders.items():
                    await closed_loop(send, raw[:5], 1)  # warm up
                    row[f"{way}_alone"] = await closed_loop(send, raw, 1)
                    row[f"{way}_concurrent"] = await closed_loop(send, raw, concurrency)
                results["sizes"][size] = row
                print_row(size, row)
            worst = results["all_new_pre_tokens"] = all_new_pre_tokens(10 if quick else 30)
            print(
                f"random letters, 800 words: tokenizers {worst['tokenizers_ms']} ms, by "
                f"pre-tokens {worst['pre_tokens_new_ms']} ms new, "
                f"{worst['pre_tokens_again_ms']} ms again"
            )
            small = bodies(tokenizer, 100, 100 if quick else 300, seed=1)
            medium = bodies(tokenizer, 1_000, 50 if quick else 150, seed=2)
            medium3 = bodies(tokenizer, 3_000, 30 if quick else 100, seed=4)
            large = bodies(tokenizer, 32_000, 8, seed=3)
            sweep: dict[str, Any] = {}
            chosen = counting.INLINE_BODY_BYTES
            for threshold in (1024, 4096, 16 * 1024, 64 * 1024):
                counting.INLINE_BODY_BYTES = threshold
                sweep[str(threshold)] = {
                    f"{name}_during_32k": await mixed(senders["protocol"], raw, large, 2)
                    for name, raw in (("100", small), ("1k", medium), ("3k", medium3))
                }
                print_sweep(threshold, sweep[str(threshold)])
            counting.INLINE_BODY_BYTES = chosen
            results["inline_threshold_sweep"] = sweep
        finally:
            await channel.close()
            await service.stop(0)
    out = ROOT / "bench-results" / "tokens.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out.relative_to(ROOT)}")


def print_row(size: str, row: dict[str, Any]) -> None:
    c = row["count"]
    print(
        f"{size:>4} tokens ({c['tokens_per_request']} tok, {c['body_bytes']} B): count "
        f"{c['new_tokens_per_s']:,} tok/s new text, "
        f"{c['seen_tokens_per_s']:,} tok/s seen before, "
        f"{c['other_new_tokens_per_s']:,} tok/s new text of other scripts"
    )
    for key in ("decide_alone", "decide_concurrent", "protocol_alone", "protocol_concurrent"):
        r = row[key]
        print(
            f"      {key:<20} p50 {r['p50_ms']:8.2f} ms  p99 {r['p99_ms']:8.2f} ms  "
            f"{r['tokens_per_s']:>10,} tok/s  refused {r['refused'] or '-'}"
        )


def print_sweep(threshold: int, row: dict[str, Any]) -> None:
    parts = [f"{k}: p50 {v['p50_ms']:.2f} p99 {v['p99_ms']:.2f} ms" for k, v in row.items()]
    print(f"inline <= {threshold:>6} B  " + "  |  ".join(parts))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests")
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    uvloop.run(main(args.quick, args.concurrency))
