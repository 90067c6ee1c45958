"""kvguard as the endpoint picker behind the real Envoy, started from the shipped envoy.yaml with
its vllm cluster holding two pods (recording upstreams on 127.0.0.1 that serve vLLM's /metrics):
each request reaches the pod kvguard reserved it on (the override_host policy reading the
`envoy.lb` metadata, or an ORIGINAL_DST cluster reading the destination header, as llm-d's
chart and kgateway configure one), and a request Envoy sends elsewhere has its lease moved to
the pod that served it (the served key, read on the response headers where the gateway sends
them, as the Gateway API Inference Extension's gateways do)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvguard.app import Service
from kvguard.extproc.picker import DESTINATION
from kvguard.ops.discovery import pod_address
from kvguard.testing.envoy import (
    EXT_PROC_FILTER,
    UPSTREAM_CLUSTER,
    EnvoyProcess,
    cluster,
    http_filter,
    loopback_config,
    on_upstreams,
    original_dst,
)
from kvguard.testing.upstream import RecordingUpstream
from kvguard.testing.wait import wait_until
from tests.extproc.harness import released, running
from tests.ops.fakes import REAL_METRICS, with_labels

LONG = {"model": "qwen", "messages": [{"role": "user", "content": "a story"}], "max_tokens": 512}
SHORT = {**LONG, "max_tokens": 16}
HELD = {"x-tenant-id": "acme", "x-test-delay": "2"}  # each answer waits 2 s upstream


@asynccontextmanager
async def two_pods(
    tmp_path: Path,
    extra: RecordingUpstream | None = None,
    token_delay: float = 0.0,
    send_response_headers: bool = False,
    upstream: str = "override_host",
    metrics: tuple[str, str] = (REAL_METRICS, REAL_METRICS),
    refresh_seconds: float = 1,
) -> AsyncIterator[tuple[Service, EnvoyProcess, list[RecordingUpstream]]]:
    """kvguard reading two pods (and `extra`, which Envoy's cluster does not hold), behind
    Envoy whose vllm cluster holds the two (streaming a token every `token_delay` seconds),
    its ext_proc sent the response headers when asked; `upstream` "original_dst": the cluster
    an ORIGINAL_DST one that reads the destination header instead; each pod serves its text of
    `metrics`, read every `refresh_seconds`."""
    pods = [RecordingUpstream(metrics=text, token_delay=token_delay) for text in metrics]
    async with AsyncExitStack() as stack:
        for server in [*pods, *([extra] if extra else [])]:
            await server.start()
            stack.push_async_callback(server.stop)
        urls = [u.url for u in pods] + ([extra.url] if extra else [])
        pool = {"capacity": {"endpoints": urls, "refresh_seconds": refresh_seconds}}
        service, _ = await stack.enter_async_context(running(tmp_path, pool=pool))
        config = on_upstreams(loopback_config(service.grpc.port, 0), [u.port for u in pods])
        if upstream == "original_dst":
            config = original_dst(config)
        if send_response_headers:  # as the Gateway API Inference Extension's gateways do
            http_filter(config, EXT_PROC_FILTER)["processing_mode"]["response_header_mode"] = "SEND"
        assert (cluster(config, UPSTREAM_CLUSTER)["type"] == "ORIGINAL_DST") == (
            upstream == "original_dst"
        )
        envoy = await stack.enter_async_context(EnvoyProcess(config, tmp_path))
        await envoy.wait_cluster_healthy("kvguard")

        async def read() -> bool:
            capacity = service.capacities.get("qwen")
            return capacity is not None and len(capacity.pods) == len(urls)

        await wait_until(read, "every pod read", timeout_s=10)
        yield service, envoy, pods


async def post(
    http: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] = HELD
) -> tuple[int, bytes]:
    async with http.post(url, json=body, headers=headers) as answer:
        return answer.status, await answer.read()


@pytest.mark.parametrize("upstream", ["override_host", "original_dst"])
async def test_each_request_reaches_the_pod_it_is_reserved_on(
    tmp_path: Path, upstream: str
) -> None:
    async with (
        two_pods(tmp_path, upstream=upstream) as (service, envoy, pods),
        aiohttp.ClientSession() as http,
    ):
        url = f"{envoy.url}/v1/chat/completions"
        sent: list[asyncio.Task[tuple[int, bytes]]] = []
        by_pod: dict[str, int] = {}
        # Long and short alternating, each in flight before the next: the flood that sent every
        # long one to the same engine under round robin.
        for i, body in enumerate([LONG, SHORT] * 3):
            sent.append(asyncio.create_task(post(http, url, body)))
            arrived = sum(len(p.requests) for p in pods)
            await wait_until(
                lambda n=i + 1: sum(len(p.requests) for p in pods) >= n,
                f"request {i} upstream (after {arrived})",
                timeout_s=10,
            )
        usage = await service.ledger.usage("qwen")
        addresses = [pod_address(pod.url) for pod in pods]
        answers = await asyncio.gather(*sent)
        await wait_until(lambda: released(service), "every lease released", timeout_s=10)
    assert all(status == 200 for status, _ in answers), answers
    for pod, address in zip(pods, addresses, strict=True):
        for request in pod.requests:
            # Every request went to the pod kvguard named, and the ledger counted it there.
            assert request.headers[DESTINATION] == address
            by_pod[address] = by_pod.get(address, 0) + 1
    assert sorted(by_pod.values()) == [3, 3]  # both pods serve
    # Long ones take 5 blocks of 128, short ones 1: each goes where the most stay free after it
    # (the first pod on a tie), long, short, long on one pod and short, long, short on the other.
    assert sorted(usage.pods.values()) == [7, 11] and usage.reserved == 18


async def test_each_models_requests_reach_its_own_pools_pods(tmp_path: Path) -> None:
    """Two pools (models) of one pod each, both pods in Envoy's one vllm cluster: each request
    goes to its model's pod, with no Envoy change for the second model."""
    pods = [RecordingUpstream(metrics=REAL_METRICS) for _ in range(2)]
    async with AsyncExitStack() as stack:
        for upstream in pods:
            await upstream.start()
            stack.push_async_callback(upstream.stop)
        first = {"capacity": {"endpoints": [pods[0].url], "refresh_seconds": 1}}
        second = {
            "name": "other",
            "models": ["other"],
            "capacity": {"endpoints": [pods[1].url], "refresh_seconds": 1},
        }
        service, _ = await stack.enter_async_context(
            running(tmp_path, pool=first, more_pools=[second])
        )
        config = on_upstreams(loopback_config(service.grpc.port, 0), [u.port for u in pods])
        envoy = await stack.enter_async_context(EnvoyProcess(config, tmp_path))
        await envoy.wait_cluster_healthy("kvguard")
        await wait_until(
            lambda: all(service.capacities.get(p) is not None for p in ("qwen", "other")),
            "both pools read",
            timeout_s=10,
        )
        http = await stack.enter_async_context(aiohttp.ClientSession())
        url = f"{envoy.url}/v1/chat/completions"
        headers = {"x-tenant-id": "acme"}
        for model in ["qwen", "other"] * 4:
            status, _ = await post(http, url, {**SHORT, "model": model}, headers)
            assert status == 200
        await wait_until(
            lambda: released(service, ("qwen", "other")), "every lease released", timeout_s=10
        )
    models = [[r.json()["model"] for r in pod.requests] for pod in pods]
    assert models == [["qwen"] * 4, ["other"] * 4]


async def test_a_lease_follows_its_request_to_the_pod_that_served_it(tmp_path: Path) -> None:
    # A third pod kvguard reads, with the most free blocks, that Envoy's cluster does not
    # hold (not yet in its endpoints): the pick names it, Envoy's fallback serves elsewhere.
    larger = RecordingUpstream(metrics=with_labels(REAL_METRICS, num_gpu_blocks="101"))
    # Streamed, 100 tokens 50 ms apart: the response's headers come at once, its end 5 s later.
    streamed = {**LONG, "max_tokens": 100, "stream": True}
    async with (
        two_pods(tmp_path, extra=larger, token_delay=0.05, send_response_headers=True) as (
            service,
            envoy,
            pods,
        ),
        aiohttp.ClientSession() as http,
    ):
        url = f"{envoy.url}/v1/chat/completions"
        task = asyncio.create_task(post(http, url, streamed, {"x-tenant-id": "acme"}))
        await wait_until(
            lambda: sum(len(p.requests) for p in pods) == 1, "the request upstream", timeout_s=10
        )
        (served,) = [p for p in pods if p.requests]
        assert served.requests[0].headers[DESTINATION] == pod_address(larger.url)

        async def moved() -> bool:
            pods_now = (await service.ledger.usage("qwen")).pods
            return pods_now == {pod_address(served.url): 1}

        await wait_until(moved, "the lease on the pod that served it", timeout_s=10)
        status, _ = await task
        await wait_until(lambda: released(service), "the lease released", timeout_s=10)
    assert status == 200 and not larger.requests


async def test_a_pod_that_refuses_the_connection_is_retried_on_another(tmp_path: Path) -> None:
    """The pod kvguard picks (the one with more free blocks, read before it went away) refuses
    the connection: Envoy's retry sends the request to the other pod, and it is answered."""
    larger = with_labels(REAL_METRICS, num_gpu_blocks="101")
    async with (
        two_pods(tmp_path, metrics=(larger, REAL_METRICS), refresh_seconds=60) as (
            service,
            envoy,
            pods,
        ),
        aiohttp.ClientSession() as http,
    ):
        gone = pod_address(pods[0].url)
        await pods[0].stop()  # its last reading stands: it is still the pick
        status, _ = await post(http, f"{envoy.url}/v1/chat/completions", SHORT)
        await wait_until(lambda: released(service), "the lease released", timeout_s=10)
    assert status == 200
    (request,) = pods[1].requests
    assert request.headers[DESTINATION] == gone
