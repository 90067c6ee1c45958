"""k8s/overlays/inference-pool, built offline with the real kubectl: kvguard as the endpoint
picker of an InferencePool (inference.networking.k8s.io/v1), its fields checked against the v1
API as the Gateway API Inference Extension v1.0.0 documents it (api/v1/inferencepool_types.go),
the picker's Deployment, Service and policy agreeing with it, and no gateway of kvguard's own."""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.manifests import (
    K8S,
    PICKERS,
    Resource,
    build,
    container,
    find,
    of_kind,
    pod_spec,
    validate,
)
from tests.deploy.workloads import kvguard_config

NAME = "overlays/inference-pool"
_PORT = {
    "type": "object",
    "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}},
    "required": ["number"],
    "additionalProperties": False,
}
_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
# InferencePoolSpec of v1 (v1.0.0): selector.matchLabels only, one target port, the picker's
# reference (a Service by default, port 9002 by default, FailClose by default).
INFERENCE_POOL = {
    "type": "object",
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": {
            "type": "object",
            "properties": {"name": _NAME, "namespace": _NAME, "labels": {"type": "object"}},
            "required": ["name"],
        },
        "spec": {
            "type": "object",
            "properties": {
                "selector": {
                    "type": "object",
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "additionalProperties": {"type": "string"},
                            "minProperties": 1,
                        }
                    },
                    "required": ["matchLabels"],
                    "additionalProperties": False,
                },
                "targetPorts": {"type": "array", "items": _PORT, "minItems": 1, "maxItems": 1},
                "endpointPickerRef": {
                    "type": "object",
                    "properties": {
                        "group": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": _NAME,
                        "port": _PORT,
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                    "required": ["name"],
                    "additionalProperties": False,
                },
            },
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "additionalProperties": False,
        },
    },
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def resources() -> tuple[Resource, ...]:
    assert PICKERS == (NAME,)
    return build(NAME)


def test_it_builds_and_every_kubernetes_resource_validates(resources: tuple[Resource, ...]) -> None:
    for resource in resources:
        if resource["kind"] in ("InferencePool", "HTTPRoute"):
            continue  # CRDs: checked below
        try:
            validate(resource)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
            pytest.fail(f"{resource['kind']}/{resource['metadata']['name']}: {exc}")


def test_the_inference_pool_is_a_v1_pool_whose_picker_is_kvguard(
    resources: tuple[Resource, ...],
) -> None:
    (pool,) = of_kind(resources, "InferencePool")
    jsonschema.validate(pool, INFERENCE_POOL)
    spec = pool["spec"]
    ref = spec["endpointPickerRef"]
    assert (ref.get("kind", "Service"), ref.get("failureMode")) == ("Service", "FailClose")
    # The picker's Service, on the port kvguard listens on, selecting the picker's pods.
    service = find(resources, "Service", ref["name"])
    (port,) = service["spec"]["ports"]
    assert port["port"] == ref["port"]["number"] == 9002
    picker = find(resources, "Deployment", "kvguard-picker")
    labels = picker["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    kvguard = container(picker, "kvguard")
    named = {p["name"]: p["containerPort"] for p in kvguard["ports"]}
    assert named[port["targetPort"]] == 9002
    config = kvguard_config(resources)
    assert config.server.grpc_listen == "0.0.0.0:9002"
    # The pool's pods are those kvguard reads: the headless Service with the same selector.
    (policy_pool,) = config.pools
    assert policy_pool.picks and policy_pool.capacity.service is not None
    vllm = find(resources, "Service", policy_pool.capacity.service.split(":")[0])
    assert vllm["spec"]["selector"] == spec["selector"]["matchLabels"]
    assert vllm["spec"]["ports"][0]["port"] == spec["targetPorts"][0]["number"]


def test_the_picker_serves_tls_from_its_secret(resources: tuple[Resource, ...]) -> None:
    tls = kvguard_config(resources).server.tls
    assert tls is not None
    picker = find(resources, "Deployment", "kvguard-picker")
    mounts = {m["mountPath"]: m["name"] for m in container(picker, "kvguard")["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(picker)["volumes"]}
    for path in (tls.certificate_file, tls.key_file):
        folder = path.rsplit("/", 1)[0]
        assert volumes[mounts[folder]]["secret"]["secretName"] == "kvguard-picker-tls"
    # The kubelet's gRPC probes speak no TLS: the probes look at the port.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container(picker, "kvguard")[probe]["tcpSocket"] == {"port": 9002}


def test_the_picker_fetches_the_tokenizer_as_the_sidecar_does(
    resources: tuple[Resource, ...],
) -> None:
    """The same init container as components/kvguard-sidecar's (model, revision, folder), so
    that the two never count with different tokenizer files."""
    sidecar = yaml.safe_load((K8S / "components" / "kvguard-sidecar" / "sidecar.yaml").read_text())
    (expected,) = [
        c for c in pod_spec(sidecar)["initContainers"] if c["name"] == "kvguard-tokenizer"
    ]
    picker = find(resources, "Deployment", "kvguard-picker")
    (fetcher,) = pod_spec(picker)["initContainers"]
    assert {**fetcher, "image": expected["image"]} == expected
    (pool,) = kvguard_config(resources).pools
    env = {e["name"]: e.get("value") for e in fetcher["env"]}
    assert env["TOKENIZER_DIR"] == pool.tokenizer


def test_the_route_sends_the_gateways_requests_to_the_pool(
    resources: tuple[Resource, ...],
) -> None:
    (route,) = of_kind(resources, "HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    (pool,) = of_kind(resources, "InferencePool")
    assert backend == {
        "group": "inference.networking.k8s.io",
        "kind": "InferencePool",
        "name": pool["metadata"]["name"],
    }


def test_only_the_gateway_and_the_pickers_reach_vllm_and_no_envoy_of_its_own(
    resources: tuple[Resource, ...],
) -> None:
    policy = find(resources, "NetworkPolicy", "kvguard-vllm")
    (ingress,) = policy["spec"]["ingress"]
    allowed = [entry["podSelector"]["matchLabels"] for entry in ingress["from"]]
    assert allowed == [
        {"gateway.networking.k8s.io/gateway-name": "inference-gateway"},
        {"app.kubernetes.io/name": "kvguard-picker"},
    ]
    workloads = {w["metadata"]["name"] for w in of_kind(resources, "Deployment")}
    assert workloads == {"kvguard-picker", "kvguard-redis"}
    names: list[Any] = [cm["metadata"]["name"] for cm in of_kind(resources, "ConfigMap")]
    assert "kvguard-gateway-envoy" not in names
    # The pickers share the base's Redis ledger, which lets in the pods labelled for it.
    redis = find(resources, "NetworkPolicy", "kvguard-redis")
    (entry,) = redis["spec"]["ingress"][0]["from"]
    labels = find(resources, "Deployment", "kvguard-picker")["spec"]["template"]["metadata"]
    assert entry["podSelector"]["matchLabels"].items() <= labels["labels"].items()
    assert kvguard_config(resources).ledger.url.startswith("redis://")
