"""kvguard as the endpoint picker of a pool of two vLLM servers (their /metrics served by fakes
on 127.0.0.1), over a real gRPC stream as Envoy drives it: each admitted request names the pod
it was reserved on (the destination header and `envoy.lb` metadata), the gateway's subset hint
restricts the pods (503 when it leaves none), and a lease served elsewhere moves there."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from envoy.config.core.v3.base_pb2 import Metadata
from google.protobuf.struct_pb2 import Struct

from kvguard.app import Service
from kvguard.extproc import picker
from kvguard.extproc.responses import METADATA_NAMESPACE
from kvguard.ops.discovery import pod_address
from kvguard.testing.wait import wait_until
from tests.extproc.harness import (
    body,
    exchange,
    headers,
    refusal,
    released,
    response_headers,
    running,
)
from tests.extproc.harness import set_headers as sent_headers
from tests.ops.fakes import REAL_METRICS, fake_vllms

CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 100}


@asynccontextmanager
async def picking(tmp_path: Path) -> AsyncIterator[tuple[Service, Any, list[str]]]:
    """A Service picking among two servers (63 usable blocks of 128 tokens each: a limit of
    53), once both are read; the stub, and the pods' addresses in the order of a tie."""
    async with fake_vllms(REAL_METRICS, REAL_METRICS) as servers:
        urls = [server.url for server in servers]
        pool = {"capacity": {"endpoints": urls, "refresh_seconds": 1}}
        async with running(tmp_path, pool=pool) as (service, stub):

            async def known() -> bool:
                capacity = service.capacities.get("qwen")
                return capacity is not None and len(capacity.pods) == 2

            await wait_until(known, "both servers read", timeout_s=10)
            yield service, stub, sorted(pod_address(url) for url in urls)


def with_metadata(message: Any, namespace: str, fields: dict[str, Any]) -> Any:
    struct = Struct()
    struct.update(fields)
    message.metadata_context.CopyFrom(Metadata(filter_metadata={namespace: struct}))
    return message


def lb(answer: Any) -> dict[str, str]:
    fields = answer.dynamic_metadata.fields
    if picker.LB_NAMESPACE not in fields:
        return {}
    return {k: v.string_value for k, v in fields[picker.LB_NAMESPACE].struct_value.fields.items()}


async def test_each_request_is_sent_to_the_pod_it_is_reserved_on(tmp_path: Path) -> None:
    async with picking(tmp_path) as (service, stub, pods):
        forged = {picker.DESTINATION: "10.9.9.9:1", picker.SUBSET: "10.9.9.9:1"}
        calls, picked = [], []
        for _ in range(3):
            call, (first, answer) = await exchange(
                stub, headers("/v1/chat/completions", forged), body(CHAT)
            )
            calls.append(call)
            removed = first.request_headers.response.header_mutation.remove_headers
            assert {picker.DESTINATION, picker.SUBSET} <= set(removed)
            sent = sent_headers(answer.request_body.response)
            kvguard = answer.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields
            assert lb(answer) == {picker.DESTINATION: sent[picker.DESTINATION]}
            assert kvguard["pod"].string_value == sent[picker.DESTINATION]
            picked.append(sent[picker.DESTINATION])
        # The first takes the first of a tie; each next the pod left with more free blocks.
        assert picked == [pods[0], pods[1], pods[0]]
        usage = await service.ledger.usage("qwen")
        assert usage.pods == {pods[0]: 2, pods[1]: 1}
        # The gauge kvguard_pod_reserved_blocks reads the same, one series per pod read.
        await wait_until(
            lambda: service.metrics.view.pods == {"qwen": {pods[0]: 2, pods[1]: 1}},
            lambda: f"the view's pods ({service.metrics.view.pods})",
            timeout_s=10,
        )
        for call in calls:
            await call.done_writing()
        await wait_until(lambda: released(service), "every lease released", timeout_s=10)


async def test_the_gateways_subset_restricts_the_pods(tmp_path: Path) -> None:
    async with picking(tmp_path) as (service, stub, pods):
        hint = {picker.SUBSET: [pods[1]]}
        for fields in (hint, {picker.SUBSET: f" {pods[1]} ,10.9.9.9:1"}):
            message = with_metadata(
                headers("/v1/chat/completions"), picker.SUBSET_NAMESPACE, fields
            )
            call, (_, answer) = await exchange(stub, message, body(CHAT))
            assert lb(answer) == {picker.DESTINATION: pods[1]}
            await call.done_writing()
        nowhere = with_metadata(
            headers("/v1/chat/completions"), picker.SUBSET_NAMESPACE, {picker.SUBSET: []}
        )
        _, (_, answer) = await exchange(stub, nowhere, body(CHAT))
        status, sent, error = refusal(answer)
        assert (status, sent["x-kvguard-reason"]) == (503, "no_endpoint_in_subset")
        assert error["error"]["code"] == "no_endpoint_in_subset"
        await wait_until(lambda: released(service), "nothing held", timeout_s=10)


async def test_a_lease_served_by_another_pod_moves_there(tmp_path: Path) -> None:
    async with picking(tmp_path) as (service, stub, pods):
        call, (_, answer) = await exchange(stub, headers("/v1/chat/completions"), body(CHAT))
        assert lb(answer)[picker.DESTINATION] == pods[0]
        served = with_metadata(response_headers(200), picker.LB_NAMESPACE, {picker.SERVED: pods[1]})
        await call.write(served)
        await call.read()

        async def moved() -> bool:
            return (await service.ledger.usage("qwen")).pods == {pods[1]: 1}

        await wait_until(moved, "the lease on the pod that served it", timeout_s=10)
        await call.done_writing()
        await wait_until(lambda: released(service), "the lease released", timeout_s=10)
