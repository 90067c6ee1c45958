"""Offline checks of the deployment files: build the kustomizations with a real kubectl, validate
resources against Kubernetes' and Istio's schemas, and turn EnvoyFilter patches into a bootstrap
that a real Envoy can validate.

Nothing here talks to a cluster. The Kubernetes schemas are the strict JSON schemas that
`kubernetes-validate` ships; the Istio ones are generated from `cloudcoil-models-istio`
(pydantic models generated from Istio's CRDs) and made strict (no unknown fields) here.
"""

from __future__ import annotations

import copy
import functools
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

from kvguard.testing.envoy import (
    EXT_PROC_FILTER,
    HTTP_CONNECTION_MANAGER,
    KVGUARD_CLUSTER,
    http_connection_manager,
    http_filters,
    listener,
    virtual_hosts,
)

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
KUBECTL = ROOT / ".cache" / "tools" / "kubectl"
# The oldest Kubernetes the manifests are written for: native sidecars (initContainers with
# restartPolicy: Always) are on by default from 1.29, the preStop `sleep` action from 1.30.
KUBERNETES_VERSION = "1.30"
# Every kustomization a user can apply (components are built through them).
KUSTOMIZATIONS = (
    "base",
    "overlays/sample-vllm",
    "overlays/existing-vllm",
    "overlays/external-redis",
    "overlays/istio-gateway",
    "overlays/istio-sidecar",
)
# Those whose kvguard is an InferencePool's endpoint picker, behind a gateway of the cluster's
# (no Envoy, no sidecar of kvguard's own): tests/deploy/test_inference_pool.py.
PICKERS = ("overlays/inference-pool",)

Resource = dict[str, Any]
# What envoy/envoy.yaml sets on its HTTP connection manager for kvguard's sake.
KVGUARD_HCM_KEYS = ("local_reply_config", "access_log")
# The response side's filter: an observing ext_proc after kvguard's (docs/design.md).
OBSERVE_FILTER = "kvguard.observe"


def kubectl() -> Path:
    if not KUBECTL.is_file():
        raise FileNotFoundError(
            f"{KUBECTL} is missing: run `make .cache/tools/kubectl` "
            "(or `python tests/deploy/fetch_kubectl.py`)"
        )
    return KUBECTL


def kustomize(directory: Path) -> list[Resource]:
    """`kubectl kustomize DIRECTORY`, parsed; raises CalledProcessError with kustomize's message."""
    result = subprocess.run(
        [str(kubectl()), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0:
        raise subprocess.CalledProcessError(
            result.returncode, result.args, result.stdout, result.stderr
        )
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@functools.cache
def build(name: str) -> tuple[Resource, ...]:
    """The resources of k8s/NAME, built once per test session (treat them as read-only)."""
    return tuple(kustomize(K8S / name))


def find(resources: tuple[Resource, ...] | list[Resource], kind: str, name: str) -> Resource:
    matches = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def of_kind(resources: tuple[Resource, ...] | list[Resource], kind: str) -> list[Resource]:
    return [r for r in resources if r["kind"] == kind]


def pod_spec(workload: Resource) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def container(workload: Resource, name: str) -> dict[str, Any]:
    spec = pod_spec(workload)
    found: list[dict[str, Any]] = [
        c for c in spec.get("containers", []) + spec.get("initContainers", []) if c["name"] == name
    ]
    assert len(found) == 1, f"{workload['metadata']['name']}: expected one container {name!r}"
    return found[0]


def yaml_files() -> Iterator[Path]:
    yield from sorted(K8S.rglob("*.yaml"))


# --- schemas -------------------------------------------------------------------------------


def _istio_models() -> dict[tuple[str, str], Any]:
    from cloudcoil.models.istio.networking import v1 as networking_v1
    from cloudcoil.models.istio.networking import v1alpha3
    from cloudcoil.models.istio.security import v1 as security_v1

    return {
        ("networking.istio.io/v1alpha3", "EnvoyFilter"): v1alpha3.EnvoyFilter,
        ("networking.istio.io/v1", "Gateway"): networking_v1.Gateway,
        ("networking.istio.io/v1", "VirtualService"): networking_v1.VirtualService,
        ("security.istio.io/v1", "RequestAuthentication"): security_v1.RequestAuthentication,
        ("security.istio.io/v1", "AuthorizationPolicy"): security_v1.AuthorizationPolicy,
    }


ISTIO_KINDS = frozenset(kind for _, kind in _istio_models())


def _strict(schema: Any) -> Any:
    """`schema` with every object that lists its properties closed to others (as the API
    server's strict field validation would be); free-form maps (a patch's `value`) stay open."""
    if isinstance(schema, dict):
        out = {key: _strict(value) for key, value in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    return schema


@functools.cache
def _istio_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    model = _istio_models()[(api_version, kind)]
    schema = _strict(model.model_json_schema(by_alias=True))
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    validator: jsonschema.protocols.Validator = validator_class(schema)
    return validator


def validate(resource: Mapping[str, Any]) -> None:
    """Validate against the strict schema of its kind; raises on an unknown kind or field."""
    if resource["kind"] in ISTIO_KINDS:
        _istio_validator(resource["apiVersion"], resource["kind"]).validate(resource)
        if not str(resource.get("metadata", {}).get("name", "")):
            raise jsonschema.ValidationError("metadata.name is required")
        return
    kubernetes_validate.validate(dict(resource), KUBERNETES_VERSION, strict=True)


# --- EnvoyFilter patches on a bootstrap of envoy/envoy.yaml's shape --------------------------


class PatchError(AssertionError):
    """A patch that would not apply to the gateway's shape."""


def apply_envoy_filter(bootstrap: Mapping[str, Any], envoy_filter: Resource) -> dict[str, Any]:
    """Apply the patches of an EnvoyFilter, Istio-style, to a copy of `bootstrap` (a config of
    envoy/envoy.yaml's shape: listener `gateway`, clusters `kvguard` and `vllm`).

    Supported, as this repository uses them: CLUSTER ADD; CLUSTER MERGE matched by port;
    LISTENER MERGE; NETWORK_FILTER MERGE into the HTTP connection manager; HTTP_ROUTE MERGE into
    every route of the action matched; HTTP_FILTER INSERT_FIRST, and INSERT_BEFORE a named
    sub-filter. The gateway listener stands for the one Istio builds (an ingress listener or
    virtualInbound), its routes for those Istio builds from a VirtualService.
    """
    config = copy.deepcopy(dict(bootstrap))
    clusters: list[dict[str, Any]] = config["static_resources"]["clusters"]
    for index, patch in enumerate(envoy_filter["spec"]["configPatches"]):
        where = f"{envoy_filter['metadata']['name']}.configPatches[{index}]"
        apply_to, match = patch["applyTo"], patch.get("match", {})
        operation, value = patch["patch"]["operation"], patch["patch"]["value"]
        if (apply_to, operation) == ("CLUSTER", "ADD"):
            clusters[:] = [c for c in clusters if c["name"] != value["name"]]
            clusters.append(copy.deepcopy(value))
        elif (apply_to, operation) == ("CLUSTER", "MERGE"):
            port = match["cluster"]["portNumber"]
            targets = [c for c in clusters if port in _endpoint_ports(c)]
            if not targets:
                raise PatchError(f"{where}: no cluster on port {port}")
            for target in targets:
                _merge(target, value)
        elif (apply_to, operation) == ("LISTENER", "MERGE"):
            _merge(listener(config), value)
        elif (apply_to, operation) == ("NETWORK_FILTER", "MERGE"):
            if value.get("name") != HTTP_CONNECTION_MANAGER:
                raise PatchError(f"{where}: only the HTTP connection manager is modelled")
            _merge(http_connection_manager(config), value["typed_config"])
        elif (apply_to, operation) == ("HTTP_ROUTE", "MERGE"):
            action = match.get("routeConfiguration", {}).get("vhost", {}).get("route", {})
            for route in routes(config, action.get("action", "ANY")):
                _merge(route, value)
        elif apply_to == "HTTP_FILTER" and operation == "INSERT_FIRST":
            http_filters(config).insert(0, copy.deepcopy(value))
        elif apply_to == "HTTP_FILTER" and operation == "INSERT_BEFORE":
            sub_filter = match["listener"]["filterChain"]["filter"]["subFilter"]["name"]
            filters = http_filters(config)
            names = [f["name"] for f in filters]
            if sub_filter not in names:
                raise PatchError(f"{where}: no HTTP filter {sub_filter!r} to insert before")
            filters.insert(names.index(sub_filter), copy.deepcopy(value))
        else:
            raise PatchError(f"{where}: {apply_to} {operation} is not modelled here")
    return config


# An EnvoyFilter route match's `action`, as the key of the Envoy route that has it.
_ROUTE_ACTIONS = {"ROUTE": "route", "DIRECT_RESPONSE": "direct_response"}


def routes(config: Mapping[str, Any], action: str = "ANY") -> list[dict[str, Any]]:
    """The routes of the gateway listener's virtual hosts: every one, or those whose action is
    `action` (as an EnvoyFilter matches them: ROUTE forwards, DIRECT_RESPONSE answers)."""
    found = [route for host in virtual_hosts(config) for route in host["routes"]]
    if action == "ANY":
        return found
    return [route for route in found if _ROUTE_ACTIONS[action] in route]


def without_kvguard(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of an envoy/envoy.yaml-shaped config without its ext_proc filter and kvguard
    cluster, Envoy's own answers, access log and the headers of its routes to vLLM: what an
    EnvoyFilter must add back."""
    result = copy.deepcopy(dict(config))
    filters = http_filters(result)
    filters[:] = [f for f in filters if f["name"] not in (EXT_PROC_FILTER, OBSERVE_FILTER)]
    for key in KVGUARD_HCM_KEYS:
        del http_connection_manager(result)[key]
    for route in routes(result, "ROUTE"):
        del route["response_headers_to_add"]
        del route["request_headers_to_remove"]
    clusters = result["static_resources"]["clusters"]
    clusters[:] = [c for c in clusters if c["name"] != KVGUARD_CLUSTER]
    return result


def _endpoint_ports(cluster_config: Mapping[str, Any]) -> set[int]:
    return {
        lb["endpoint"]["address"]["socket_address"]["port_value"]
        for locality in cluster_config.get("load_assignment", {}).get("endpoints", [])
        for lb in locality["lb_endpoints"]
    }


def _merge(target: dict[str, Any], value: Mapping[str, Any]) -> None:
    for key, item in value.items():
        if isinstance(item, Mapping) and isinstance(target.get(key), dict):
            _merge(target[key], item)
        else:
            target[key] = copy.deepcopy(item)


# --- Prometheus Operator resources (k8s/components/monitoring) -------------------------------


def _prometheus_operator_models() -> dict[tuple[str, str], Any]:
    from cloudcoil.models.prometheus_operator import v1 as monitoring_v1

    return {
        ("monitoring.coreos.com/v1", "PodMonitor"): monitoring_v1.PodMonitor,
        ("monitoring.coreos.com/v1", "PrometheusRule"): monitoring_v1.PrometheusRule,
    }


PROMETHEUS_OPERATOR_KINDS = frozenset(kind for _, kind in _prometheus_operator_models())


@functools.cache
def _prometheus_operator_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    model = _prometheus_operator_models()[(api_version, kind)]
    schema = _python_patterns(_strict(model.model_json_schema(by_alias=True)))
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    validator: jsonschema.protocols.Validator = validator_class(schema)
    return validator


def _python_patterns(schema: Any) -> Any:
    """`schema` with the CRDs' Go patterns that Python's re refuses made equivalent ones: Go
    takes an inline flag after the anchor (`^(?i)...`), Python only at the start (`(?i)^...`)."""
    if isinstance(schema, dict):
        out = {key: _python_patterns(value) for key, value in schema.items()}
        pattern = out.get("pattern")
        if isinstance(pattern, str) and pattern.startswith("^(?i)"):
            out["pattern"] = "(?i)^" + pattern.removeprefix("^(?i)")
        return out
    if isinstance(schema, list):
        return [_python_patterns(item) for item in schema]
    return schema


def validate_monitoring(resource: Mapping[str, Any]) -> None:
    """Validate a PodMonitor or PrometheusRule against the strict schema generated from the
    Prometheus Operator's CRDs (`cloudcoil-models-prometheus-operator`), any other resource as
    `validate` does."""
    if resource["kind"] not in PROMETHEUS_OPERATOR_KINDS:
        validate(resource)
        return
    _prometheus_operator_validator(resource["apiVersion"], resource["kind"]).validate(resource)
    if not str(resource.get("metadata", {}).get("name", "")):
        raise jsonschema.ValidationError("metadata.name is required")
