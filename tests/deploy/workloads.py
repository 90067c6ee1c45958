"""What the built kustomizations hold, as the deployment tests read it: where kvguard is
injected, its configuration, the upstream Service its pool names, the workloads, their
containers and their pods' labels."""

from __future__ import annotations

from typing import Any

from kvguard import config as configs
from tests.deploy.manifests import Resource, find, of_kind, pod_spec

# Where kvguard is injected, in each kustomization.
SIDECAR_HOSTS = {
    "base": ("Deployment", "kvguard-gateway"),
    "overlays/sample-vllm": ("Deployment", "kvguard-gateway"),
    "overlays/existing-vllm": ("Deployment", "kvguard-gateway"),
    "overlays/external-redis": ("Deployment", "kvguard-gateway"),
    "overlays/istio-gateway": ("Deployment", "kvguard-ingressgateway"),
    "overlays/istio-sidecar": ("StatefulSet", "vllm-qwen"),
}


def kvguard_config(resources: tuple[Resource, ...]) -> configs.Config:
    text = find(resources, "ConfigMap", "kvguard-config")["data"]["kvguard.yaml"]
    return configs.parse(text, "kvguard-config/kvguard.yaml", environ={})


def upstream_service(resources: tuple[Resource, ...]) -> Resource:
    """The Service that Envoy's `vllm` cluster and the pool's capacity.service both name."""
    (pool,) = kvguard_config(resources).pools
    assert pool.capacity.service is not None
    return find(resources, "Service", pool.capacity.service.rsplit(":", 1)[0])


def upstream_port(resources: tuple[Resource, ...]) -> int:
    (pool,) = kvguard_config(resources).pools
    assert pool.capacity.service is not None
    return int(pool.capacity.service.rsplit(":", 1)[1])


def workloads(resources: tuple[Resource, ...]) -> list[Resource]:
    return of_kind(resources, "Deployment") + of_kind(resources, "StatefulSet")


def all_containers(workload: Resource) -> list[dict[str, Any]]:
    spec = pod_spec(workload)
    containers: list[dict[str, Any]] = spec.get("initContainers", []) + spec["containers"]
    return containers


def pod_spec_labels(workload: Resource) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels
