"""Every shipped gateway routes by kvguard's allow-list: exactly the guarded paths (any method)
and the read-only ones (by method) go to vLLM, each by its exact path, and every other request
gets kvguard's own 404 `endpoint_not_served` from the gateway's last route. The Envoy
configurations (envoy/envoy.yaml, the k8s gateway) and the Istio gateway's VirtualService are
read and compared with kvguard.extproc.routes; the Istio sidecar's routes are Istio's, and
kvguard's own deny by default refuses there (tests/extproc/test_routes.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvguard.extproc.routes import READ_ONLY_PATHS, not_served
from kvguard.testing.envoy import SHIPPED_CONFIG, virtual_hosts
from kvguard.tokens.request import GUARDED_PATHS
from tests.deploy.manifests import K8S, ROOT, build, find

# path -> the methods it passes with; None: any method (kvguard checks each one itself).
AllowList = dict[str, frozenset[str] | None]
EXPECTED: AllowList = {
    **{path: None for path in GUARDED_PATHS},
    **{path: frozenset(methods) for path, methods in READ_ONLY_PATHS.items()},
}
NOT_SERVED_HEADERS = {"content-type": "application/json", "x-kvguard-reason": "endpoint_not_served"}
ENVOY_CONFIGS = [ROOT / "envoy" / "envoy.yaml", K8S / "base" / "gateway" / "envoy.yaml"]
# What a forwarding route may hold: nothing that rewrites the path vLLM routes on
# (prefix_rewrite, regex_rewrite) or turns a filter off for it (typed_per_filter_config).
ROUTE_KEYS = {"match", "route", "request_headers_to_remove", "response_headers_to_add"}
ACTION_KEYS = {"cluster", "timeout", "idle_timeout", "retry_policy"}
ISTIO_ROUTE_KEYS = {"name", "match", "route", "timeout"}


def methods(match: dict[str, Any]) -> frozenset[str]:
    """The methods a `:method` string match admits: an exact value or alternatives (A|B)."""
    (kind, value), *_ = match.items()
    if kind == "safe_regex":
        kind, value = "regex", value["regex"]
    assert kind in ("exact", "regex"), match
    assert not match.get("ignore_case"), match
    alternatives = value.split("|") if kind == "regex" else [value]
    assert all(a.isalpha() and a.isupper() for a in alternatives), match
    return frozenset(alternatives)


def envoy_allow_list(routes: list[dict[str, Any]]) -> tuple[AllowList, dict[str, Any]]:
    """The paths an Envoy route list forwards to vLLM, and its last (catch-all) route."""
    *forwarding, last = routes
    allowed: AllowList = {}
    for route in forwarding:
        assert set(route) <= ROUTE_KEYS, route
        assert route["route"]["cluster"] == "vllm", route
        assert set(route["route"]) <= ACTION_KEYS, route
        match = dict(route["match"])
        path = match.pop("path")  # an exact path: no prefix or regex opens more than it says
        headers = match.pop("headers", [])
        assert match == {}, route
        assert [h["name"] for h in headers] in ([], [":method"]), route
        assert all(set(h) == {"name", "string_match"} for h in headers), route  # no invert_match
        assert path not in allowed, path
        allowed[path] = methods(headers[0]["string_match"]) if headers else None
    return allowed, last


def assert_not_served_body(body: str) -> None:
    """kvguard's 404 body, byte for byte (its content-length too)."""
    assert body.encode() == not_served().body()


@pytest.mark.parametrize("path", ENVOY_CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_envoy_routes_by_the_allow_list(path: Path) -> None:
    (host,) = virtual_hosts(yaml.safe_load(path.read_text()))
    allowed, last = envoy_allow_list(host["routes"])
    assert allowed == EXPECTED
    assert last["match"] == {"prefix": "/"}
    assert last["direct_response"]["status"] == 404
    assert_not_served_body(last["direct_response"]["body"]["inline_string"])
    added = {h["header"]["key"]: h["header"]["value"] for h in last["response_headers_to_add"]}
    assert added == NOT_SERVED_HEADERS


def test_istio_gateway_routes_by_the_allow_list() -> None:
    service = find(build("overlays/istio-gateway"), "VirtualService", "vllm-qwen")
    *forwarding, last = service["spec"]["http"]
    allowed: AllowList = {}
    for route in forwarding:
        assert set(route) <= ISTIO_ROUTE_KEYS, route  # no rewrite
        assert [d["destination"]["host"] for d in route["route"]] == ["vllm-qwen"]
        for match in route["match"]:
            match = dict(match)
            (kind, path), *_ = match.pop("uri").items()
            assert kind == "exact", route
            method = match.pop("method", None)
            assert match == {}, route
            assert path not in allowed, path
            allowed[path] = methods(method) if method is not None else None
    assert allowed == EXPECTED
    assert "match" not in last  # every other request
    assert last["directResponse"]["status"] == 404
    assert_not_served_body(last["directResponse"]["body"]["string"])
    assert last["headers"]["response"]["set"] == NOT_SERVED_HEADERS


def shipped_routes() -> list[dict[str, Any]]:
    (host,) = virtual_hosts(yaml.safe_load(SHIPPED_CONFIG.read_text()))
    routes: list[dict[str, Any]] = host["routes"]
    return routes


def test_a_route_that_opens_more_than_its_path_is_caught() -> None:
    routes = shipped_routes()
    routes[0]["match"] = {"prefix": "/v1/chat/completions"}
    with pytest.raises(KeyError):
        envoy_allow_list(routes)
    routes = shipped_routes()
    del routes[4]["match"]["headers"]  # /v1/models for any method
    assert envoy_allow_list(routes)[0] != EXPECTED


@pytest.mark.parametrize(
    "change",
    [
        # vLLM would route on another path than the one matched.
        lambda route: route["route"].update(prefix_rewrite="/v1/chat/completions/batch"),
        # kvguard would not see the request.
        lambda route: route.update(
            typed_per_filter_config={"envoy.filters.http.ext_proc": {"disabled": True}}
        ),
        # Every method but GET and HEAD.
        lambda route: route["match"]["headers"][0].update(invert_match=True),
        lambda route: route["match"]["headers"][0]["string_match"].update(ignore_case=True),
    ],
    ids=["rewrite", "ext_proc-off", "invert_match", "ignore_case"],
)
def test_a_route_that_forwards_other_than_it_matches_is_caught(
    change: Callable[[dict[str, Any]], None],
) -> None:
    routes = shipped_routes()
    change(routes[4])  # /v1/models
    with pytest.raises(AssertionError):
        envoy_allow_list(routes)
