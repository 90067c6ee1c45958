"""The shipped Envoy configuration for tests: a real Envoy on loopback, and the parts of the
configuration that the tests, the benchmarks and the deployment checks look into.

The runtime half (rendering on loopback, `EnvoyProcess`) lives in kvguard.sim.envoy, which the
demo runs; it is re-exported here so that tests import one module.
"""

from __future__ import annotations

import copy
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvguard.sim.envoy import (
    KVGUARD_CLUSTER,
    LISTENER,
    LOOPBACK,
    SHIPPED_CONFIG,
    UPSTREAM_CLUSTER,
    EnvoyConfigError,
    EnvoyError,
    EnvoyProcess,
    cluster,
    envoy_binary,
    listener,
    loopback_config,
    named,
    node,
    render_envoy_config,
    tail,
)

__all__ = [
    "EXT_PROC_FILTER",
    "HTTP_CONNECTION_MANAGER",
    "KVGUARD_CLUSTER",
    "LISTENER",
    "SHIPPED_CONFIG",
    "UPSTREAM_CLUSTER",
    "EnvoyConfigError",
    "EnvoyError",
    "EnvoyProcess",
    "cluster",
    "envoy_binary",
    "http_connection_manager",
    "http_filter",
    "http_filters",
    "listener",
    "loopback_config",
    "on_upstreams",
    "original_dst",
    "render_envoy_config",
    "streamed_bodies",
    "validate_envoy_config",
    "virtual_hosts",
    "without_http_filter",
]

HTTP_CONNECTION_MANAGER = "envoy.filters.network.http_connection_manager"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"


def http_connection_manager(config: Mapping[str, Any]) -> dict[str, Any]:
    """The `typed_config` of the gateway listener's HTTP connection manager."""
    chains = node(listener(config), "filter_chains")
    if not isinstance(chains, list) or len(chains) != 1:
        raise EnvoyConfigError(f"listener {LISTENER!r}: expected exactly one filter chain")
    hcm = named(node(chains[0], "filters"), HTTP_CONNECTION_MANAGER, "network filter")
    typed_config = node(hcm, "typed_config")
    if not isinstance(typed_config, dict):
        raise EnvoyConfigError(f"{HTTP_CONNECTION_MANAGER}: typed_config is not a mapping")
    return typed_config


def http_filters(config: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The HTTP filter chain of the gateway listener's HTTP connection manager."""
    filters = node(http_connection_manager(config), "http_filters")
    if not isinstance(filters, list):
        raise EnvoyConfigError("http_filters is not a list")
    return filters


def virtual_hosts(config: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The virtual hosts of the gateway listener's route configuration."""
    hosts = node(http_connection_manager(config), "route_config", "virtual_hosts")
    if not isinstance(hosts, list):
        raise EnvoyConfigError("virtual_hosts is not a list")
    return hosts


def http_filter(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The `typed_config` of the HTTP filter called `name` (e.g. EXT_PROC_FILTER)."""
    typed_config = node(named(http_filters(config), name, "http filter"), "typed_config")
    if not isinstance(typed_config, dict):
        raise EnvoyConfigError(f"http filter {name!r}: typed_config is not a mapping")
    return typed_config


def without_http_filter(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    """A copy of `config` whose gateway listener lacks the HTTP filter `name`."""
    result = copy.deepcopy(dict(config))
    filters = http_filters(result)
    named(filters, name, "http filter")
    filters[:] = [f for f in filters if f.get("name") != name]
    return result


def on_upstreams(config: Mapping[str, Any], ports: Sequence[int]) -> dict[str, Any]:
    """A copy of `config` whose vllm cluster has one host per port of `ports` on 127.0.0.1: the
    pods of a pool, as a headless Service's DNS gives them to the STRICT_DNS cluster."""
    result = copy.deepcopy(dict(config))
    upstream = cluster(result, UPSTREAM_CLUSTER)
    upstream["type"] = "STATIC"
    upstream.pop("dns_lookup_family", None)
    hosts = [
        {"endpoint": {"address": {"socket_address": {"address": LOOPBACK, "port_value": port}}}}
        for port in ports
    ]
    upstream["load_assignment"] = {
        "cluster_name": UPSTREAM_CLUSTER,
        "endpoints": [{"lb_endpoints": hosts}],
    }
    return result


def streamed_bodies(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with kvguard's ext_proc filter as the Gateway API Inference Extension's gateways
    configure it: FULL_DUPLEX_STREAMED bodies both ways, with the trailers (Envoy needs them
    with that mode) and the response headers sent. Changed in place, and returned."""
    http_filter(config, EXT_PROC_FILTER)["processing_mode"].update(
        request_body_mode="FULL_DUPLEX_STREAMED",
        request_trailer_mode="SEND",
        response_header_mode="SEND",
        response_body_mode="FULL_DUPLEX_STREAMED",
        response_trailer_mode="SEND",
    )
    return config


def original_dst(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `config` whose vllm cluster is an ORIGINAL_DST cluster sending each request to
    the address in its x-gateway-destination-endpoint header, as llm-d's chart and kgateway
    configure an InferencePool's upstream (the compatibility mode of the endpoint picker)."""
    result = copy.deepcopy(dict(config))
    upstream = cluster(result, UPSTREAM_CLUSTER)
    for key in ("load_assignment", "load_balancing_policy", "dns_lookup_family"):
        upstream.pop(key, None)
    upstream.update(
        type="ORIGINAL_DST",
        lb_policy="CLUSTER_PROVIDED",
        original_dst_lb_config={
            "use_http_header": True,
            "http_header_name": "x-gateway-destination-endpoint",
        },
    )
    return result


def validate_envoy_config(path: Path) -> str:
    """Run `envoy --mode validate` on `path`; returns its output, raises EnvoyError if refused."""
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    output = result.stdout + result.stderr
    if result.returncode != 0:
        raise EnvoyError(f"envoy refused {path} (exit {result.returncode}):\n{tail(output)}")
    return output
