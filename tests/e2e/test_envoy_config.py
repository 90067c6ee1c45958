"""The shipped envoy/envoy.yaml: Envoy accepts it, it holds the settings docs/design.md relies
on, and the harness that runs it (EnvoyProcess, RecordingUpstream) works against a real Envoy."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from kvguard.config.schema import SHIPPED_MAX_MESSAGE_TIMEOUT_S
from kvguard.extproc.responses import METADATA_NAMESPACE, OBSERVE_HEADER
from kvguard.testing.envoy import (
    EXT_PROC_FILTER,
    KVGUARD_CLUSTER,
    SHIPPED_CONFIG,
    UPSTREAM_CLUSTER,
    EnvoyConfigError,
    EnvoyError,
    EnvoyProcess,
    cluster,
    http_filter,
    http_filters,
    listener,
    render_envoy_config,
    validate_envoy_config,
    virtual_hosts,
    without_http_filter,
)
from kvguard.testing.upstream import RecordingUpstream

pytestmark = pytest.mark.integration

KVGUARD_MAX_BODY_BYTES = 8388608  # kvguard's default server.max_body_bytes
# The response side's observing filter (docs/design.md, "The response path").
OBSERVE_FILTER = "kvguard.observe"


def render(**ports: int) -> dict[str, Any]:
    defaults = {"listen_port": 0, "admin_port": 0, "kvguard_port": 50051, "upstream_port": 8000}
    return render_envoy_config(SHIPPED_CONFIG, **(defaults | ports))


def test_envoy_accepts_the_shipped_config() -> None:
    assert "OK" in validate_envoy_config(SHIPPED_CONFIG)


def test_envoy_accepts_the_rendered_config(tmp_path: Path) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(render(listen_port=18000, admin_port=19901)))
    assert "OK" in validate_envoy_config(path)


def test_render_changes_only_addresses() -> None:
    shipped = yaml.safe_load(SHIPPED_CONFIG.read_text())
    rendered = render(listen_port=1, admin_port=2, kvguard_port=3, upstream_port=4)

    def endpoint(config: dict[str, Any], name: str) -> dict[str, Any]:
        locality = cluster(config, name)["load_assignment"]["endpoints"][0]
        address: dict[str, Any] = locality["lb_endpoints"][0]["endpoint"]["address"]
        socket_address: dict[str, Any] = address["socket_address"]
        return socket_address

    addresses: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
        "admin": lambda c: c["admin"]["address"]["socket_address"],
        "listener": lambda c: listener(c)["address"]["socket_address"],
        KVGUARD_CLUSTER: lambda c: endpoint(c, KVGUARD_CLUSTER),
        UPSTREAM_CLUSTER: lambda c: endpoint(c, UPSTREAM_CLUSTER),
    }
    assert {name: get(rendered) for name, get in addresses.items()} == {
        "admin": {"address": "127.0.0.1", "port_value": 2},
        "listener": {"address": "127.0.0.1", "port_value": 1},
        KVGUARD_CLUSTER: {"address": "127.0.0.1", "port_value": 3},
        UPSTREAM_CLUSTER: {"address": "127.0.0.1", "port_value": 4},
    }
    # Put the shipped addresses back: nothing else may differ.
    restored = copy.deepcopy(rendered)
    for get in addresses.values():
        get(restored).update(get(shipped))
    assert restored == shipped


@pytest.mark.parametrize(
    ("path", "name", "message"),
    [
        (("static_resources", "clusters"), KVGUARD_CLUSTER, "cluster named 'kvguard'"),
        (("static_resources", "clusters"), UPSTREAM_CLUSTER, "cluster named 'vllm'"),
        (("static_resources", "listeners"), "gateway", "listener named 'gateway'"),
    ],
)
def test_render_refuses_a_config_that_drifted(
    tmp_path: Path, path: tuple[str, str], name: str, message: str
) -> None:
    config = yaml.safe_load(SHIPPED_CONFIG.read_text())
    section, key = path
    config[section][key] = [item for item in config[section][key] if item["name"] != name]
    source = tmp_path / "envoy.yaml"
    source.write_text(yaml.safe_dump(config))
    with pytest.raises(EnvoyConfigError, match=message):
        render_envoy_config(source, listen_port=0, admin_port=0, kvguard_port=1, upstream_port=2)


def test_render_refuses_a_config_without_admin(tmp_path: Path) -> None:
    config = yaml.safe_load(SHIPPED_CONFIG.read_text())
    del config["admin"]
    source = tmp_path / "envoy.yaml"
    source.write_text(yaml.safe_dump(config))
    with pytest.raises(EnvoyConfigError, match="admin is missing"):
        render_envoy_config(source, listen_port=0, admin_port=0, kvguard_port=1, upstream_port=2)


def test_ext_proc_settings_match_the_design() -> None:
    config = render()
    ext_proc = http_filter(config, EXT_PROC_FILTER)
    assert ext_proc["processing_mode"] == {
        "request_header_mode": "SEND",
        "request_body_mode": "BUFFERED",
        "request_trailer_mode": "SKIP",
        "response_header_mode": "SKIP",
        "response_body_mode": "NONE",
        "response_trailer_mode": "SEND",
    }
    assert ext_proc["allow_mode_override"] is True
    assert ext_proc["failure_mode_allow"] is False
    assert ext_proc["status_on_error"] == {"code": "ServiceUnavailable"}
    assert ext_proc["message_timeout"] == "0.2s"
    # What kvguard's configuration check holds a queued request's wait and its counting to.
    assert ext_proc["max_message_timeout"] == f"{SHIPPED_MAX_MESSAGE_TIMEOUT_S:g}s"
    grpc = ext_proc["grpc_service"]["envoy_grpc"]
    assert grpc["cluster_name"] == KVGUARD_CLUSTER
    # ext_proc runs before the router, i.e. before anything reaches vLLM.
    names = [f["name"] for f in http_filters(config)]
    assert names.index(EXT_PROC_FILTER) < names.index("envoy.filters.http.router")

    # The response side: observing only, failing open, for the exchanges kvguard marks.
    assert names[-2:] == [OBSERVE_FILTER, "envoy.filters.http.router"]
    wrapper = http_filter(config, OBSERVE_FILTER)
    assert wrapper["extension_config"]["typed_config"]["@type"].endswith("Composite")
    # The composite runs the observing ext_proc only for kvguard's mark.
    (matcher,) = wrapper["xds_matcher"]["matcher_list"]["matchers"]
    marked = matcher["predicate"]["single_predicate"]
    assert marked["input"]["typed_config"]["header_name"] == OBSERVE_HEADER
    assert marked["value_match"] == {"exact": "1"}
    assert "on_no_match" not in wrapper["xds_matcher"]
    observe = matcher["on_match"]["action"]["typed_config"]["typed_config"]["typed_config"]
    assert observe["observability_mode"] is True
    assert observe["failure_mode_allow"] is True
    assert observe["grpc_service"]["envoy_grpc"]["cluster_name"] == KVGUARD_CLUSTER
    mode = dict(observe["processing_mode"])
    # The response headers are sent so that Envoy keeps the answer's content-length.
    assert (mode.pop("response_header_mode"), mode.pop("response_body_mode")) == (
        "SEND",
        "STREAMED",
    )
    assert set(mode.values()) <= {"SKIP", "NONE"}
    assert observe["metadata_options"]["forwarding_namespaces"]["untyped"] == [METADATA_NAMESPACE]
    for route in virtual_hosts(config)[0]["routes"]:
        if "route" in route:  # vLLM never sees it
            assert route["request_headers_to_remove"] == [OBSERVE_HEADER]

    # kvguard, not Envoy, must be the one to refuse bodies above its own limit.
    buffer_limit = listener(config)["per_connection_buffer_limit_bytes"]
    assert buffer_limit > KVGUARD_MAX_BODY_BYTES
    assert cluster(config, UPSTREAM_CLUSTER)["per_connection_buffer_limit_bytes"] >= buffer_limit
    assert grpc["max_receive_message_length"] > buffer_limit

    (health_check,) = cluster(config, KVGUARD_CLUSTER)["health_checks"]
    assert health_check["grpc_health_check"] == {
        "service_name": "envoy.service.ext_proc.v3.ExternalProcessor"
    }
    assert health_check["no_traffic_interval"] == "1s"


async def test_upstream_records_requests_through_a_real_envoy(
    tmp_path: Path, upstream: RecordingUpstream, refusing_port: int
) -> None:
    config = without_http_filter(
        render(kvguard_port=refusing_port, upstream_port=upstream.port), EXT_PROC_FILTER
    )
    body = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    async with EnvoyProcess(config, tmp_path) as envoy, aiohttp.ClientSession() as client:
        async with client.post(
            f"{envoy.url}/v1/chat/completions?trace=1",
            json=body,
            headers={"x-kvguard-prompt-tokens": "9", "X-Tenant-Id": "acme"},
        ) as response:
            assert response.status == 200
            answer = await response.json()
        async with client.get(f"{envoy.url}/health") as response:
            assert (response.status, await response.text()) == (200, "ok")
        async with client.post(
            f"{envoy.url}/v1/completions", json={"prompt": "a", "max_tokens": 2, "stream": True}
        ) as response:
            assert response.status == 200
            events = (await response.text()).split("\n\n")

    assert answer["usage"] == {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
    chat, other, stream = await upstream.wait_for_requests(3)
    assert (chat.method, chat.path, chat.query) == ("POST", "/v1/chat/completions", "trace=1")
    assert chat.json() == body
    assert chat.headers["x-tenant-id"] == "acme"
    assert chat.headers["x-kvguard-prompt-tokens"] == "9"
    assert "x-envoy-expected-rq-timeout-ms" not in chat.headers  # route timeout disabled
    assert (other.method, other.path, other.body) == ("GET", "/health", b"")
    assert stream.json()["stream"] is True
    assert [e for e in events if e][-1] == "data: [DONE]"
    assert upstream.in_flight == 0


async def test_requests_fail_closed_while_kvguard_is_down(
    tmp_path: Path, upstream: RecordingUpstream, refusing_port: int
) -> None:
    config = render(kvguard_port=refusing_port, upstream_port=upstream.port)
    async with EnvoyProcess(config, tmp_path) as envoy, aiohttp.ClientSession() as client:
        await envoy.wait_cluster_unhealthy(KVGUARD_CLUSTER)
        with pytest.raises(EnvoyError, match="not healthy"):
            await envoy.wait_cluster_healthy(KVGUARD_CLUSTER, timeout=0.3)
        assert await envoy.cluster_health(KVGUARD_CLUSTER) == {
            f"127.0.0.1:{refusing_port}": "/failed_active_hc"
        }
        async with client.post(f"{envoy.url}/v1/completions", json={"prompt": "a"}) as response:
            assert response.status == 503  # status_on_error; failure_mode_allow is false
        async with client.get(f"{envoy.url}/health") as response:
            assert response.status == 503
    assert upstream.requests == []
