"""Every Envoy configuration shipped in k8s/ passes `envoy --mode validate` (EnvoyFilter patches
as part of a bootstrap of envoy/envoy.yaml's shape), carries exactly envoy/envoy.yaml's ext_proc
settings, and the authenticated gateway (components/jwt-identity, its filter discovered from its
file as in the pod) really sets the tenant header from the token only."""

from __future__ import annotations

import asyncio
import base64
import copy
import hashlib
import hmac
import json
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest
import yaml

from kvguard.testing.envoy import (
    EXT_PROC_FILTER,
    KVGUARD_CLUSTER,
    SHIPPED_CONFIG,
    EnvoyError,
    EnvoyProcess,
    cluster,
    http_connection_manager,
    http_filter,
    http_filters,
    listener,
    validate_envoy_config,
    without_http_filter,
)
from kvguard.testing.upstream import RecordingUpstream
from tests.deploy.envoy_files import (
    CREDENTIAL,
    IDENTITY,
    WITH_API_KEY,
    build_variant,
    envoy_args,
    envoy_files,
    localized,
    on_loopback,
    static_form,
    with_files,
)
from tests.deploy.manifests import (
    KUSTOMIZATIONS,
    KVGUARD_HCM_KEYS,
    OBSERVE_FILTER,
    PatchError,
    apply_envoy_filter,
    build,
    of_kind,
    routes,
    without_kvguard,
)

pytestmark = pytest.mark.integration  # runs the real Envoy binary

GATEWAY_CONFIG = Path(__file__).resolve().parents[2] / "k8s" / "base" / "gateway" / "envoy.yaml"
HEADER_FIRST = "envoy.filters.http.header_mutation"
ROUTER = "envoy.filters.http.router"


def shipped() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(SHIPPED_CONFIG.read_text())
    return config


def embedded_envoy_configs() -> list[tuple[str, str]]:
    """(where, text) of every envoy.yaml held by a ConfigMap of any kustomization."""
    found = {}
    for name in KUSTOMIZATIONS:
        for cm in of_kind(build(name), "ConfigMap"):
            for key, text in cm.get("data", {}).items():
                if key.endswith(".yaml") and "static_resources" in text:
                    found[text] = f"{name}: ConfigMap/{cm['metadata']['name']}[{key}]"
    return [(where, text) for text, where in found.items()]


def envoy_filters() -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{name}: EnvoyFilter/{f['metadata']['name']}", f)
        for name in KUSTOMIZATIONS
        for f in of_kind(build(name), "EnvoyFilter")
    ]


def test_configmaps_hold_the_gateway_config() -> None:
    embedded = embedded_envoy_configs()
    assert [text for _, text in embedded] == [GATEWAY_CONFIG.read_text()]


# Every plain gateway as built, with the filters and clusters it chose.
GATEWAYS = (*[n for n in KUSTOMIZATIONS if not n.startswith("overlays/istio")], WITH_API_KEY)


@pytest.mark.parametrize("name", GATEWAYS)
def test_each_gateway_validates_with_the_files_it_chose(tmp_path: Path, name: str) -> None:
    """envoy.yaml as the pod reads it (its files beside it) and as one static bootstrap with
    those files inlined: `--mode validate` reads no discovered file, the second form checks
    them too, as strictly as envoy.yaml itself."""
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "api-key").write_text("k")
    files = localized(envoy_files(build_variant(name)), tmp_path / "etc-envoy", secret)
    for form, config in (
        ("discovered", yaml.safe_load(files["envoy.yaml"])),
        ("static", static_form(files)),
    ):
        path = tmp_path / f"{form}.yaml"
        path.write_text(yaml.safe_dump(config))
        assert "OK" in validate_envoy_config(path), f"{name} ({form})"


def test_envoy_refuses_a_broken_gateway_config(tmp_path: Path) -> None:
    config = static_form(envoy_files(build("overlays/sample-vllm")))
    jwt = http_filter(config, IDENTITY)
    jwt["providers"]["tenants"]["claim_to_headers"][0]["header_nam"] = "x"
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(EnvoyError, match="header_nam"):
        validate_envoy_config(path)


def kvguard_settings(config: dict[str, Any]) -> dict[str, Any]:
    """What envoy/envoy.yaml sets for kvguard's sake: the ext_proc filter and the observing one,
    the kvguard cluster, Envoy's own answers, the access log, the response headers and removed
    request header of each route to vLLM, and the routes that answer by themselves."""
    hcm = http_connection_manager(config)
    forwarding = routes(config, "ROUTE")
    return {
        "ext_proc": http_filter(config, EXT_PROC_FILTER),
        "observe": http_filter(config, OBSERVE_FILTER),
        "request_headers_to_remove": [r["request_headers_to_remove"] for r in forwarding],
        "cluster": cluster(config, KVGUARD_CLUSTER),
        **{key: hcm[key] for key in KVGUARD_HCM_KEYS},
        "response_headers_to_add": [r["response_headers_to_add"] for r in forwarding],
        "direct_responses": routes(config, "DIRECT_RESPONSE"),
    }


def test_gateway_config_keeps_envoy_yamls_ext_proc_settings() -> None:
    gateway = yaml.safe_load(GATEWAY_CONFIG.read_text())
    assert kvguard_settings(gateway) == kvguard_settings(shipped())
    for key in ("per_connection_buffer_limit_bytes",):
        assert listener(gateway)[key] == listener(shipped())[key]
    names = [f["name"] for f in http_filters(gateway)]
    assert names == [HEADER_FIRST, IDENTITY, EXT_PROC_FILTER, OBSERVE_FILTER, CREDENTIAL, ROUTER]


@pytest.mark.parametrize(("where", "envoy_filter"), envoy_filters(), ids=lambda v: str(v)[:40])
def test_envoy_filter_patches_validate_in_a_bootstrap(
    tmp_path: Path, where: str, envoy_filter: dict[str, Any]
) -> None:
    config = apply_envoy_filter(without_kvguard(shipped()), envoy_filter)
    # The patches put back exactly what envoy/envoy.yaml has, in the same place...
    assert kvguard_settings(config) == kvguard_settings(shipped())
    names = [f["name"] for f in http_filters(config)]
    assert names[0] != EXT_PROC_FILTER, where
    assert names[-3:] == [EXT_PROC_FILTER, OBSERVE_FILTER, ROUTER], where
    assert http_filters(config)[0]["typed_config"]["@type"].endswith("HeaderMutation")
    # ...with buffers above kvguard's max_body_bytes on both sides...
    assert listener(config)["per_connection_buffer_limit_bytes"] == 16777216
    assert cluster(config, "vllm")["per_connection_buffer_limit_bytes"] == 16777216
    # ...and Envoy accepts the result.
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(config))
    assert "OK" in validate_envoy_config(path), where


def test_bootstrap_builder_refuses_a_patch_that_would_not_apply() -> None:
    envoy_filter = copy.deepcopy(envoy_filters()[0][1])
    for patch in envoy_filter["spec"]["configPatches"]:
        if patch["patch"]["operation"] == "INSERT_BEFORE":
            patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] = "nope"
    with pytest.raises(PatchError, match="nope"):
        apply_envoy_filter(without_kvguard(shipped()), envoy_filter)


# --- the authenticated gateway, run for real ----------------------------------------------

SECRET = b"kvguard-test-signing-key-0123456789"
ISSUER, AUDIENCE = "https://auth.example.com/", "kvguard"


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def token(claims: dict[str, Any], secret: bytes = SECRET) -> str:
    header = b64url(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "test"}).encode())
    body = b64url(json.dumps(claims).encode())
    signature = hmac.new(secret, f"{header}.{body}".encode(), hashlib.sha256).digest()
    return f"{header}.{body}.{b64url(signature)}"


# The gateway of overlays/sample-vllm: components/jwt-identity's filter in its slot.
JWT_GATEWAY = "overlays/sample-vllm"


def local_gateway(
    folder: Path, upstream_port: int, edit: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """overlays/sample-vllm's gateway on loopback, its files discovered from `folder` as in the
    pod, without ext_proc (no kvguard here), its JWKS inline (an HS256 test key) instead of
    fetched from the identity provider; `edit` changes the provider."""
    files = envoy_files(build(JWT_GATEWAY))
    identity = yaml.safe_load(files["identity.yaml"])
    provider = identity["resources"][0]["typed_config"]["providers"]["tenants"]
    assert (provider["issuer"], provider["audiences"]) == (ISSUER, [AUDIENCE])
    del provider["remote_jwks"]
    jwks = {"keys": [{"kty": "oct", "alg": "HS256", "kid": "test", "k": b64url(SECRET)}]}
    provider["local_jwks"] = {"inline_string": json.dumps(jwks)}
    if edit is not None:
        edit(provider)
    files = with_files(files, {"identity.yaml": identity, "clusters.yaml": {"resources": []}})
    config = on_loopback(files, folder, kvguard_port=1, upstream_port=upstream_port)
    config = without_http_filter(without_http_filter(config, EXT_PROC_FILTER), OBSERVE_FILTER)
    clusters = config["static_resources"]["clusters"]
    clusters[:] = [c for c in clusters if c["name"] != KVGUARD_CLUSTER]
    return config


def run(config: dict[str, Any], tmp_path: Path) -> EnvoyProcess:
    """A real Envoy for `config`, with the options the gateway pod gives it."""
    return EnvoyProcess(config, tmp_path, args=envoy_args(build(JWT_GATEWAY)))


async def post(
    client: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> int:
    async with client.post(url, json=body, headers=headers) as response:
        await response.read()
        return response.status


def bearer(claims: dict[str, Any], secret: bytes = SECRET) -> dict[str, str]:
    return {"authorization": f"Bearer {token(claims, secret)}"}


async def test_tenant_header_comes_from_the_token_only(tmp_path: Path) -> None:
    upstream = RecordingUpstream()
    await upstream.start()
    claims = {"iss": ISSUER, "aud": AUDIENCE, "sub": "u1", "exp": int(time.time()) + 600}
    acme = claims | {"tenant": "acme"}
    body = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    forged = {"x-tenant-id": "someone-else"}
    try:
        config = local_gateway(tmp_path / "etc-envoy", upstream.port)
        async with run(config, tmp_path) as envoy, aiohttp.ClientSession() as client:
            url = f"{envoy.url}/v1/chat/completions"
            assert await post(client, url, body, forged) == 401  # no token
            assert await post(client, url, body, forged | bearer(acme, b"wrong key")) == 401
            assert await post(client, url, body, bearer(acme | {"exp": 1})) == 401  # expired
            assert await post(client, url, body, forged | bearer(acme)) == 200
            assert await post(client, url, body, forged | bearer(claims)) == 200  # no claim
            assert (await envoy_ready(envoy, client))[0] == 200
        admitted, anonymous = await upstream.wait_for_requests(2)
    finally:
        await upstream.stop()
    assert admitted.headers["x-tenant-id"] == "acme"  # the claim; the client's copy is gone
    assert "authorization" not in admitted.headers  # the token stays at the gateway
    assert "x-tenant-id" not in anonymous.headers  # no claim: no tenant, not the client's
    assert len(upstream.requests) == 2  # nothing unauthenticated got through


async def test_client_tenant_header_is_removed_before_authentication(tmp_path: Path) -> None:
    """The first filter drops the client's copy by itself, whatever jwt_authn then does."""
    upstream = RecordingUpstream()
    await upstream.start()
    config = local_gateway(
        tmp_path / "etc-envoy",
        upstream.port,
        lambda provider: provider.update(
            claim_to_headers=[{"header_name": "x-claimed-tenant", "claim_name": "tenant"}]
        ),
    )
    claims = {"iss": ISSUER, "aud": AUDIENCE, "exp": int(time.time()) + 600, "tenant": "acme"}
    body = {"model": "m", "prompt": "a", "max_tokens": 1}
    try:
        async with run(config, tmp_path) as envoy, aiohttp.ClientSession() as client:
            headers = {"x-tenant-id": "forged"} | bearer(claims)
            assert await post(client, f"{envoy.url}/v1/completions", body, headers) == 200
        (request,) = await upstream.wait_for_requests(1)
    finally:
        await upstream.stop()
    assert request.headers["x-claimed-tenant"] == "acme"
    assert "x-tenant-id" not in request.headers


async def envoy_ready(envoy: EnvoyProcess, client: aiohttp.ClientSession) -> tuple[int, str]:
    """GET /ready on the `health` listener (the kubelet's readiness probe)."""
    async with client.get(f"{envoy.admin_url}/listeners?format=json") as response:
        statuses = (await response.json())["listener_statuses"]
    (health,) = [s for s in statuses if s["name"] == "health"]
    port = health["local_address"]["socket_address"]["port_value"]
    async with client.get(f"http://127.0.0.1:{port}/ready") as response:
        return response.status, await response.text()


# --- the `vllm` cluster behind a DNS alias ------------------------------------------------

ALIAS_TARGET = "vllm-headless.vllm.svc.cluster.local"
ALIASED_PODS = ("127.0.0.2", "127.0.0.3")
CARES_RESOLVER = (
    "type.googleapis.com/envoy.extensions.network.dns_resolver.cares.v3.CaresDnsResolverConfig"
)


def dns_name(name: str) -> bytes:
    return b"".join(bytes([len(p)]) + p.encode() for p in name.strip(".").split(".")) + b"\0"


def dns_record(name: str, rtype: int, rdata: bytes) -> bytes:
    return dns_name(name) + struct.pack("!HHIH", rtype, 1, 5, len(rdata)) + rdata


class AliasingDns(asyncio.DatagramProtocol):
    """A DNS server that answers every A query for kvguard-vllm (under any search domain) as
    CoreDNS answers for an ExternalName Service: the CNAME to a headless Service and, in the
    same answer, that Service's pod addresses. Other queries get no records."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        end = data.index(b"\0", 12) + 5  # the question: its name, type and class
        labels, offset = [], 12
        while data[offset]:
            labels.append(data[offset + 1 : offset + 1 + data[offset]].decode())
            offset += 1 + data[offset]
        (qtype,) = struct.unpack("!H", data[end - 4 : end - 2])
        answers = []
        if labels[0] == "kvguard-vllm" and qtype == 1:
            answers.append(dns_record(".".join(labels), 5, dns_name(ALIAS_TARGET)))
            answers += [dns_record(ALIAS_TARGET, 1, socket.inet_aton(a)) for a in ALIASED_PODS]
        header = data[:2] + struct.pack("!HHHHH", 0x8180, 1, len(answers), 0, 0)
        self.transport.sendto(header + data[12:end] + b"".join(answers), addr)


async def test_vllm_cluster_follows_an_alias_to_every_pod(tmp_path: Path) -> None:
    """overlays/existing-vllm's alias for a vLLM in another namespace: Envoy's STRICT_DNS
    cluster follows the CNAME and balances over every address it leads to."""
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(AliasingDns, local_addr=("127.0.0.1", 0))
    dns_port = transport.get_extra_info("sockname")[1]
    shipped_vllm = cluster(yaml.safe_load(GATEWAY_CONFIG.read_text()), "vllm")
    config = local_gateway(tmp_path / "etc-envoy", upstream_port=8000)
    vllm = cluster(config, "vllm")
    vllm["load_assignment"] = copy.deepcopy(shipped_vllm["load_assignment"])  # kvguard-vllm
    vllm["typed_dns_resolver_config"] = {
        "name": "envoy.network.dns_resolver.cares",
        "typed_config": {
            "@type": CARES_RESOLVER,
            "resolvers": [{"socket_address": {"address": "127.0.0.1", "port_value": dns_port}}],
        },
    }
    try:
        async with run(config, tmp_path) as envoy, aiohttp.ClientSession() as client:
            hosts = await vllm_hosts(envoy, client, expected=len(ALIASED_PODS))
    finally:
        transport.close()
    assert hosts == {(address, 8000) for address in ALIASED_PODS}


async def vllm_hosts(
    envoy: EnvoyProcess, client: aiohttp.ClientSession, expected: int, timeout: float = 10.0
) -> set[tuple[str, int]]:
    """The `vllm` cluster's hosts, once it has `expected` of them (or the deadline passed)."""
    deadline = time.monotonic() + timeout
    while True:
        async with client.get(f"{envoy.admin_url}/clusters?format=json") as response:
            statuses = (await response.json())["cluster_statuses"]
        (vllm,) = [s for s in statuses if s["name"] == "vllm"]
        addresses = [h["address"]["socket_address"] for h in vllm.get("host_statuses", [])]
        hosts = {(a["address"], a["port_value"]) for a in addresses}
        if len(hosts) >= expected or time.monotonic() > deadline:
            return hosts
        await asyncio.sleep(0.1)
