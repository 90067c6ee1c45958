"""The two filters a kustomization chooses for the gateway's Envoy, read from their files by a
real Envoy as the pod reads them: what vLLM is called with (no client credential; with
components/vllm-api-key, vLLM's --api-key from a Secret, rotated in place), in the right place
(after kvguard has read the tenant's API key), and a filter file Envoy refuses failing closed."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from kvguard import config as configs
from kvguard.app import Service
from kvguard.testing.envoy import (
    EXT_PROC_FILTER,
    KVGUARD_CLUSTER,
    EnvoyProcess,
    without_http_filter,
)
from kvguard.testing.upstream import RecordedRequest, RecordingUpstream
from kvguard.testing.wait import wait_until
from tests.conftest import kvguard_config, write_config
from tests.deploy.envoy_files import (
    CREDENTIAL,
    CREDENTIAL_INJECTOR,
    HEADER_MUTATION,
    SECRET_MOUNT,
    WITH_API_KEY,
    KubeletSecret,
    build_variant,
    envoy_args,
    envoy_files,
    on_loopback,
    slot_filter,
    with_files,
)
from tests.deploy.manifests import KUSTOMIZATIONS, OBSERVE_FILTER, container, find
from tests.deploy.workloads import kvguard_config as shipped_policy

pytestmark = pytest.mark.integration  # runs the real Envoy binary

PLAIN = [name for name in KUSTOMIZATIONS if not name.startswith("overlays/istio")]
SECRET_NAME, SECRET_KEY = "kvguard-vllm-api-key", "api-key"
TENANT_KEY, VLLM_KEY = "sk-tenant-acme-0123456789", "vllm-key-one"
CHAT = {"model": "qwen", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


# --- what each kustomization chose -----------------------------------------------------------


@pytest.mark.parametrize("name", PLAIN)
def test_no_client_credential_reaches_vllm(name: str) -> None:
    assert slot_filter(envoy_files(build_variant(name)), CREDENTIAL) == {
        "@type": HEADER_MUTATION,
        "mutations": {"request_mutations": [{"remove": "authorization"}]},
    }


def test_the_vllm_key_comes_from_a_secret_to_envoy_and_kvguard() -> None:
    """components/vllm-api-key: Envoy's credential is a file of the Secret's mount (no key in
    any ConfigMap), kvguard's capacity.api_key_file the same file in its own mount of it."""
    resources = build_variant(WITH_API_KEY)
    files = envoy_files(resources)
    injector = slot_filter(files, CREDENTIAL)
    assert injector["@type"] == CREDENTIAL_INJECTOR
    assert (injector["overwrite"], injector["allow_request_without_credential"]) == (True, False)
    generic = injector["credential"]["typed_config"]
    assert generic.get("header", "Authorization") == "Authorization"
    assert generic["header_value_prefix"] == "Bearer "
    sds = generic["credential"]["sds_config"]["path_config_source"]
    assert sds["watched_directory"] == {"path": SECRET_MOUNT}  # rotation: the kubelet's swap
    sds_file = sds["path"].removeprefix("/etc/envoy/")
    (secret,) = yaml.safe_load(files[sds_file])["resources"]
    assert secret["name"] == generic["credential"]["name"]
    assert secret["generic_secret"] == {"secret": {"filename": f"{SECRET_MOUNT}/{SECRET_KEY}"}}

    gateway = find(resources, "Deployment", "kvguard-gateway")
    (volume,) = [v for v in gateway["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    assert volume["secret"] == {"secretName": SECRET_NAME}  # required: no pod without the key
    for each in ("envoy", "kvguard"):
        mounts = [
            m for m in container(gateway, each)["volumeMounts"] if m["name"] == volume["name"]
        ]
        assert mounts == [{"name": volume["name"], "mountPath": SECRET_MOUNT, "readOnly": True}]
    (pool,) = shipped_policy(resources).pools
    assert pool.capacity.api_key_file == secret["generic_secret"]["secret"]["filename"]


# --- run by a real Envoy -----------------------------------------------------------------------


def without_kvguard(config: dict[str, Any]) -> dict[str, Any]:
    """The gateway without its ext_proc filters and kvguard cluster (no kvguard here)."""
    config = without_http_filter(without_http_filter(config, EXT_PROC_FILTER), OBSERVE_FILTER)
    clusters = config["static_resources"]["clusters"]
    clusters[:] = [c for c in clusters if c["name"] != KVGUARD_CLUSTER]
    return config


def gateway(
    tmp_path: Path,
    upstream: RecordingUpstream,
    *,
    name: str,
    kvguard_port: int | None = None,
    files: dict[str, str] | None = None,
    args: list[str] | None = None,
) -> EnvoyProcess:
    """The gateway of kustomization `name` (its `files` when given) on loopback, discovering
    its files from tmp_path/etc-envoy and the vLLM key from tmp_path/secret, run with the pod's
    options (or `args`); without kvguard unless `kvguard_port`."""
    config = on_loopback(
        files or envoy_files(build_variant(name)),
        tmp_path / "etc-envoy",
        kvguard_port=kvguard_port or 1,
        upstream_port=upstream.port,
        secret=tmp_path / "secret",
    )
    if kvguard_port is None:
        config = without_kvguard(config)
    options = envoy_args(build_variant(name)) if args is None else args
    return EnvoyProcess(config, tmp_path, args=options)


async def post(
    client: aiohttp.ClientSession, url: str, headers: dict[str, str]
) -> tuple[int, dict[str, str]]:
    async with client.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers) as response:
        await response.read()
        return response.status, {k.lower(): v for k, v in response.headers.items()}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_the_client_authorization_is_removed(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    async with (
        gateway(tmp_path, upstream, name="base") as envoy,
        aiohttp.ClientSession() as client,
    ):
        assert (await post(client, envoy.url, bearer(TENANT_KEY)))[0] == 200
    (request,) = await upstream.wait_for_requests(1)
    assert "authorization" not in request.headers


async def test_vllm_gets_the_secrets_key_and_follows_its_rotation(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    secret = KubeletSecret(tmp_path / "secret")
    secret.write({SECRET_KEY: VLLM_KEY + "\n"})  # a key file written with its newline
    async with (
        gateway(tmp_path, upstream, name=WITH_API_KEY) as envoy,
        aiohttp.ClientSession() as client,
    ):
        assert (await post(client, envoy.url, bearer(TENANT_KEY)))[0] == 200
        assert (await post(client, envoy.url, {}))[0] == 200
        first, anonymous = await upstream.wait_for_requests(2)
        secret.write({SECRET_KEY: "vllm-key-two"})

        async def rotated() -> bool:
            await post(client, envoy.url, bearer(TENANT_KEY))
            return upstream.requests[-1].headers["authorization"] == "Bearer vllm-key-two"

        await wait_until(rotated, "Envoy to read the Secret's new key")
    assert first.headers["authorization"] == f"Bearer {VLLM_KEY}"  # not the tenant's
    assert anonymous.headers["authorization"] == f"Bearer {VLLM_KEY}"
    assert not [r for r in upstream.requests if TENANT_KEY in str(r.headers)]


async def test_without_the_key_vllm_is_not_called(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    """The Secret's file missing (never mounted, say): Envoy answers itself, in the OpenAI
    error schema, rather than call vLLM with no key or the client's."""
    (tmp_path / "secret").mkdir()
    async with (
        gateway(tmp_path, upstream, name=WITH_API_KEY) as envoy,
        aiohttp.ClientSession() as client,
    ):
        status, headers = await post(client, envoy.url, bearer(TENANT_KEY))
    assert (status, headers["x-kvguard-reason"]) == (500, "gateway_error")
    assert upstream.requests == []


async def test_an_identity_file_envoy_refuses_fails_closed(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    """A field Envoy does not know (a misspelt jwt_authn rule, say) makes the pod's Envoy refuse
    the file, and a filter without its configuration answers every request 500; without the
    pod's --reject-unknown-dynamic-fields the field would be dropped and requests let through."""
    files = envoy_files(build_variant("base"))
    identity = yaml.safe_load(files["identity.yaml"])
    identity["resources"][0]["typed_config"]["mutation"] = {}  # `mutations` misspelt
    files = with_files(files, {"identity.yaml": identity})
    assert "--reject-unknown-dynamic-fields" in envoy_args(build_variant("base"))
    async with aiohttp.ClientSession() as client:
        async with gateway(tmp_path / "pod", upstream, name="base", files=files) as envoy:
            status, headers = await post(client, envoy.url, {})
        assert (status, headers["x-kvguard-reason"]) == (500, "gateway_error")
        assert upstream.requests == []
        lax = gateway(tmp_path / "lax", upstream, name="base", files=files, args=[])
        async with lax as envoy:
            assert (await post(client, envoy.url, {}))[0] == 200


async def test_kvguard_reads_the_tenants_key_before_vllms_replaces_it(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    """tenancy.identity: api_key behind components/vllm-api-key, with a real kvguard: the
    tenant is the one of the client's key (a key kvguard does not know is refused 401 before
    vLLM), and vLLM gets its own key only."""
    KubeletSecret(tmp_path / "secret").write({SECRET_KEY: VLLM_KEY})
    data = kvguard_config(default_tier=None)
    digest = hashlib.sha256(TENANT_KEY.encode()).hexdigest()
    data["tenancy"].update(identity="api_key", api_keys={digest: "acme"})
    service = Service(configs.load(write_config(tmp_path, data), environ={}))
    await service.start()
    try:
        envoy = gateway(tmp_path, upstream, name=WITH_API_KEY, kvguard_port=service.grpc.port)
        async with envoy, aiohttp.ClientSession() as client:
            await envoy.wait_cluster_healthy(KVGUARD_CLUSTER)
            assert (await post(client, envoy.url, bearer(TENANT_KEY)))[0] == 200
            status, headers = await post(client, envoy.url, bearer(VLLM_KEY))
            assert (status, headers["x-kvguard-reason"]) == (401, "unknown_tenant")
        requests: list[RecordedRequest] = list(upstream.requests)
    finally:
        await service.stop(0)
        await service.keeper.settle()
    (admitted,) = requests
    assert admitted.headers["authorization"] == f"Bearer {VLLM_KEY}"
    assert "x-kvguard-prompt-tokens" in admitted.headers  # kvguard admitted it
