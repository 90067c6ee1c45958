"""The NetworkPolicy kvguard-vllm: on exactly the pods the gateway routes to and meters, it lets
in only the gateway's pods (Envoy's requests, kvguard's reads of /metrics), on vLLM's port, and
Prometheus besides with components/monitoring. A client that could call vLLM directly would
bypass every guard."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.envoy_files import edited_build
from tests.deploy.manifests import K8S, KUSTOMIZATIONS, Resource, build, find, kustomize, of_kind
from tests.deploy.workloads import (
    SIDECAR_HOSTS,
    pod_spec_labels,
    upstream_port,
    upstream_service,
    workloads,
)

POLICY = "kvguard-vllm"
# Where each kustomization's Envoy and kvguard run: the pods the policy must let in.
GATEWAYS = {
    "base": ("Deployment", "kvguard-gateway"),
    "overlays/sample-vllm": ("Deployment", "kvguard-gateway"),
    "overlays/existing-vllm": ("Deployment", "kvguard-gateway"),
    "overlays/external-redis": ("Deployment", "kvguard-gateway"),
    "overlays/istio-gateway": ("Deployment", "kvguard-ingressgateway"),
}
# kvguard runs in the vLLM pods' own sidecars: every request they take in passes it.
GUARDED_IN_THE_POD = ("overlays/istio-sidecar",)


def test_every_kustomization_protects_its_vllm_pods_or_guards_inside_them() -> None:
    assert set(GATEWAYS) | set(GUARDED_IN_THE_POD) == set(KUSTOMIZATIONS)
    for name in GUARDED_IN_THE_POD:
        resources = build(name)
        assert [
            p for p in of_kind(resources, "NetworkPolicy") if p["metadata"]["name"] == POLICY
        ] == []
        kind, workload = SIDECAR_HOSTS[name]
        assert kind == "StatefulSet" and workload.startswith("vllm-")


def selected(resources: tuple[Resource, ...], labels: dict[str, str]) -> list[tuple[str, str]]:
    return [
        (w["kind"], w["metadata"]["name"])
        for w in workloads(resources)
        if labels.items() <= pod_spec_labels(w).items()
    ]


def the_gateway_rule(policy: Resource) -> dict[str, Any]:
    rule: dict[str, Any] = policy["spec"]["ingress"][0]
    return rule


@pytest.mark.parametrize("name", GATEWAYS)
def test_only_the_gateway_reaches_the_vllm_pods_on_vllms_port(name: str) -> None:
    resources = build(name)
    policy = find(resources, "NetworkPolicy", POLICY)
    spec = policy["spec"]
    # The pods the gateway routes to and meters, by the very same labels.
    assert spec["podSelector"] == {"matchLabels": upstream_service(resources)["spec"]["selector"]}
    assert "Ingress" in spec["policyTypes"]
    (rule,) = spec["ingress"]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # pods of this namespace, no address range
    assert rule["ports"] == [{"port": upstream_port(resources), "protocol": "TCP"}]
    # The peer is the gateway's pods and nothing else; they run kvguard, whose capacity
    # discovery reads /metrics on that same port.
    assert selected(resources, peer["podSelector"]["matchLabels"]) == [GATEWAYS[name]]
    gateway = find(resources, *GATEWAYS[name])
    sidecars = gateway["spec"]["template"]["spec"]["initContainers"]
    assert "kvguard" in [c["name"] for c in sidecars]


def test_the_sample_pool_is_what_the_policy_protects() -> None:
    resources = build("overlays/sample-vllm")
    labels = find(resources, "NetworkPolicy", POLICY)["spec"]["podSelector"]["matchLabels"]
    assert selected(resources, labels) == [("StatefulSet", "vllm-qwen")]


def test_the_policy_follows_the_pods_existing_vllm_is_told_to_select() -> None:
    """overlays/existing-vllm: the one edit of vllm.yaml's labels moves the Service and the
    policy together."""
    labels = {"app.kubernetes.io/name": "my-vllm", "app.kubernetes.io/instance": "prod"}

    def edit(text: str) -> str:
        assert "    app: vllm  # EDIT: your vLLM pods' labels\n" in text
        return text.replace(
            "    app: vllm  # EDIT: your vLLM pods' labels\n",
            "".join(f"    {key}: {value}\n" for key, value in labels.items()),
        )

    resources = edited_build("overlays/existing-vllm", {"vllm.yaml": edit})
    assert upstream_service(resources)["spec"]["selector"] == labels
    policy = find(resources, "NetworkPolicy", POLICY)
    assert policy["spec"]["podSelector"] == {"matchLabels": labels}
    assert selected(resources, labels) == []  # the user's pods, which the overlay does not deploy


def with_monitoring(target: str, tmp_path: Path) -> tuple[Resource, ...]:
    kustomization = {
        "resources": [os.path.relpath(K8S / target, tmp_path)],
        "components": [os.path.relpath(K8S / "components" / "monitoring", tmp_path)],
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return tuple(kustomize(tmp_path))


@pytest.mark.parametrize("target", ["base", "overlays/existing-vllm", "overlays/istio-gateway"])
def test_monitoring_lets_prometheus_in_beside_the_gateway(tmp_path: Path, target: str) -> None:
    resources = with_monitoring(target, tmp_path)
    gateway_rule, prometheus = find(resources, "NetworkPolicy", POLICY)["spec"]["ingress"]
    assert gateway_rule == the_gateway_rule(find(build(target), "NetworkPolicy", POLICY))
    # Prometheus's own namespace: with any namespace, a pod anyone labels `prometheus` there
    # would reach the whole API on that port, around kvguard.
    assert prometheus == {
        "from": [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
            }
        ],
        "ports": [{"port": upstream_port(resources), "protocol": "TCP"}],
    }


def test_monitoring_builds_where_no_policy_is_needed(tmp_path: Path) -> None:
    resources = with_monitoring("overlays/istio-sidecar", tmp_path)
    assert POLICY not in [p["metadata"]["name"] for p in of_kind(resources, "NetworkPolicy")]
