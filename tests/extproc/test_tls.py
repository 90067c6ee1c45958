"""TLS on the ext_proc port (`server.tls`), as the gateways that call an endpoint picker connect:
gRPC clients that verify the certificate, and the real Envoy with an empty validation context.

The certificate in tests/data/tls is self-signed for 127.0.0.1 and localhost, valid for a
century: test data, never a secret."""

from __future__ import annotations

import json
import ssl
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvguard import config as configs
from kvguard.app import Service
from kvguard.testing.envoy import EnvoyProcess, cluster, loopback_config
from kvguard.testing.upstream import RecordingUpstream
from tests.conftest import kvguard_config, write_config
from tests.extproc.harness import running

TLS = Path(__file__).parents[1] / "data" / "tls"
CERTIFICATE, KEY = TLS / "kvguard.crt", TLS / "kvguard.key"
SERVER_TLS = {"certificate_file": str(CERTIFICATE), "key_file": str(KEY)}
CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}]}
SERVING = health_pb2.HealthCheckResponse.SERVING


async def check(channel: grpc.aio.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    answer = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
    return int(answer.status)


async def test_a_tls_port_answers_verified_clients_and_refuses_plaintext(tmp_path: Path) -> None:
    async with running(tmp_path, tls=SERVER_TLS) as (service, _):
        target = f"127.0.0.1:{service.grpc.port}"
        credentials = grpc.ssl_channel_credentials(root_certificates=CERTIFICATE.read_bytes())
        async with grpc.aio.secure_channel(target, credentials) as channel:
            assert await check(channel) == SERVING
        async with grpc.aio.insecure_channel(target) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await check(channel)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE


def test_a_certificate_without_its_key_is_an_error_naming_the_files(tmp_path: Path) -> None:
    data = kvguard_config(tls={"certificate_file": str(CERTIFICATE), "key_file": str(CERTIFICATE)})
    config = configs.load(write_config(tmp_path, data), environ={})
    with pytest.raises(ssl.SSLError, match=f"server.tls: {CERTIFICATE} and {CERTIFICATE} are"):
        Service(config)
    data["server"]["tls"]["key_file"] = str(tmp_path / "absent.key")
    with pytest.raises(FileNotFoundError):
        Service(configs.load(write_config(tmp_path, data), environ={}))


def test_tls_names_both_files() -> None:
    with pytest.raises(configs.ConfigError, match=r"server\.tls\.key_file"):
        configs.parse(
            json.dumps({**kvguard_config(), "server": {"tls": {"certificate_file": "c"}}}),
            "kvguard.yaml",
            environ={},
        )


def envoy_over_tls(kvguard_port: int, upstream_port: int) -> dict[str, Any]:
    """The shipped Envoy configuration with TLS to kvguard, as GIE gateways connect to an
    endpoint picker: encrypted, the certificate not verified (an empty validation context)."""
    config = loopback_config(kvguard_port, upstream_port)
    cluster(config, "kvguard")["transport_socket"] = {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/"
            "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "common_tls_context": {"alpn_protocols": ["h2"], "validation_context": {}},
        },
    }
    return config


async def test_the_real_envoy_reaches_kvguard_over_tls(tmp_path: Path) -> None:
    upstream = RecordingUpstream()
    await upstream.start()
    try:
        async with (
            running(tmp_path, tls=SERVER_TLS) as (service, _),
            EnvoyProcess(envoy_over_tls(service.grpc.port, upstream.port), tmp_path) as envoy,
            aiohttp.ClientSession() as http,
        ):
            await envoy.wait_cluster_healthy("kvguard")  # its health checks, over TLS too
            url = f"{envoy.url}/v1/chat/completions"
            async with http.post(url, json=CHAT, headers={"x-tenant-id": "acme"}) as answer:
                assert answer.status == 200, await answer.text()
    finally:
        await upstream.stop()
    (received,) = upstream.requests
    assert received.headers["x-kvguard-lease"]
    assert received.json()["max_tokens"] == 128  # the pro tier's default: kvguard decided it
