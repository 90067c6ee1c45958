"""The manifests agree with kvguard's configuration and with docs/deployment.md's shape:
ports, names, the tenant header, the ledger, probes, drain, hardening, and vLLM's flags."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvguard import config as configs
from kvguard.admission import policy
from kvguard.testing.envoy import KVGUARD_CLUSTER, cluster, http_filters, listener
from tests.conftest import model_dir
from tests.deploy.envoy_files import (
    HEADER_MUTATION,
    IDENTITY,
    JWT_AUTHN,
    envoy_files,
    extra_clusters,
    slot_filter,
)
from tests.deploy.manifests import (
    K8S,
    KUSTOMIZATIONS,
    ROOT,
    Resource,
    build,
    container,
    find,
    kustomize,
    of_kind,
    pod_spec,
    validate,
)
from tests.deploy.workloads import (
    SIDECAR_HOSTS,
    all_containers,
    kvguard_config,
    pod_spec_labels,
    upstream_port,
    upstream_service,
    workloads,
)

ISTIO = ("overlays/istio-gateway", "overlays/istio-sidecar")
# The kustomizations whose gateway is the base's plain Envoy (k8s/base/gateway).
PLAIN_GATEWAYS = tuple(name for name in KUSTOMIZATIONS if name not in ISTIO)


def envoy_configs(resources: tuple[Resource, ...]) -> list[dict[str, Any]]:
    return [
        yaml.safe_load(text)
        for cm in of_kind(resources, "ConfigMap")
        for key, text in cm.get("data", {}).items()
        if key == "envoy.yaml"
    ]


def kvguard_port(resources: tuple[Resource, ...]) -> int:
    return int(kvguard_config(resources).server.grpc_listen.rsplit(":", 1)[1])


def host(name: str) -> Resource:
    kind, workload = SIDECAR_HOSTS[name]
    return find(build(name), kind, workload)


def envoy_filter_values(resources: tuple[Resource, ...], apply_to: str) -> list[dict[str, Any]]:
    return [
        patch["patch"]["value"]
        for envoy_filter in of_kind(resources, "EnvoyFilter")
        for patch in envoy_filter["spec"]["configPatches"]
        if patch["applyTo"] == apply_to
    ]


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_exactly_one_envoy_consults_kvguard(name: str) -> None:
    """Two ext_proc filters on one request's path would reserve its blocks twice."""
    resources = build(name)
    ext_procs = [
        f for f in envoy_filter_values(resources, "HTTP_FILTER") if "ext_proc" in f["name"]
    ]
    assert len(envoy_configs(resources)) + len(ext_procs) == 1
    injected = [
        w
        for w in of_kind(resources, "Deployment") + of_kind(resources, "StatefulSet")
        if any(c["name"] == "kvguard" for c in pod_spec(w).get("initContainers", []))
    ]
    assert [(w["kind"], w["metadata"]["name"]) for w in injected] == [SIDECAR_HOSTS[name]]


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_grpc_port_agrees_everywhere(name: str) -> None:
    """server.grpc_listen's port = the kvguard cluster's port = the probes' port."""
    resources = build(name)
    port = kvguard_port(resources)
    assert kvguard_config(resources).server.grpc_listen.startswith("0.0.0.0:")  # kubelet probes
    sidecar = container(host(name), "kvguard")
    probes = [sidecar[p]["grpc"] for p in ("startupProbe", "readinessProbe", "livenessProbe")]
    assert {probe["port"] for probe in probes} == {port}
    assert port in {p["containerPort"] for p in sidecar["ports"]}
    clusters = [cluster(c, KVGUARD_CLUSTER) for c in envoy_configs(resources)] + [
        v for v in envoy_filter_values(resources, "CLUSTER") if v.get("name") == KVGUARD_CLUSTER
    ]
    assert clusters
    for kvguard_cluster in clusters:
        (locality,) = kvguard_cluster["load_assignment"]["endpoints"]
        (endpoint,) = locality["lb_endpoints"]
        assert endpoint["endpoint"]["address"]["socket_address"] == {
            "address": "127.0.0.1",  # the native sidecar, over localhost
            "port_value": port,
        }


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_probes_use_grpc_health(name: str) -> None:
    sidecar = container(host(name), "kvguard")
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar
    assert sidecar["readinessProbe"]["grpc"].get("service", "") == ""
    assert sidecar["livenessProbe"]["grpc"]["service"] == "liveness"
    # The pod's other containers start when kvguard serves, not when vLLM is up.
    assert sidecar["startupProbe"]["grpc"]["service"] == "liveness"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_configuration_is_mounted_as_a_directory(name: str) -> None:
    """A subPath mount would never see a ConfigMap update; the hot reload needs the folder."""
    workload = host(name)
    sidecar = container(workload, "kvguard")
    assert sidecar["args"] == ["--config", "/etc/kvguard/kvguard.yaml"]
    (mount,) = [m for m in sidecar["volumeMounts"] if m["mountPath"] == "/etc/kvguard"]
    assert "subPath" not in mount and mount.get("readOnly") is True
    (volume,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == "kvguard-config"
    find(build(name), "ConfigMap", "kvguard-config")  # shipped, and under that exact name


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_grace_period_covers_the_drains(name: str) -> None:
    resources = build(name)
    workload = host(name)
    drain = kvguard_config(resources).server.drain_seconds
    pre_stop = [
        c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        for c in pod_spec(workload)["containers"]
    ]
    assert pod_spec(workload)["terminationGracePeriodSeconds"] > drain + max(pre_stop)


@pytest.mark.parametrize("name", PLAIN_GATEWAYS)
def test_gateway_pods_are_hardened(name: str) -> None:
    gateway = find(build(name), "Deployment", "kvguard-gateway")
    spec = pod_spec(gateway)
    for each in spec["containers"] + spec["initContainers"]:
        security = each["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] != 0
        assert security["readOnlyRootFilesystem"] is True
        assert security["allowPrivilegeEscalation"] is False
        assert security["capabilities"] == {"drop": ["ALL"]}
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}
        assert each["resources"]["requests"]["cpu"] and each["resources"]["requests"]["memory"]
        assert each["resources"]["limits"]["memory"]
    assert spec["automountServiceAccountToken"] is False


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_injected_sidecar_is_hardened(name: str) -> None:
    security = container(host(name), "kvguard")["securityContext"]
    assert security == {
        "runAsNonRoot": True,
        "runAsUser": 65532,
        "runAsGroup": 65532,
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def test_gateway_replicas_share_a_redis_ledger() -> None:
    resources = build("base")
    config = kvguard_config(resources)
    replicas = find(resources, "Deployment", "kvguard-gateway")["spec"]["replicas"]
    assert replicas > 1
    assert config.ledger.url.startswith("redis://")  # memory:// cannot be shared
    url = urllib.parse.urlsplit(config.ledger.url)
    redis = find(resources, "Service", url.hostname or "")
    assert url.port in {p["port"] for p in redis["spec"]["ports"]}
    (redis_pod,) = [
        d for d in of_kind(resources, "Deployment") if d["metadata"]["name"] == url.hostname
    ]
    assert redis["spec"]["selector"].items() <= pod_spec_labels(redis_pod).items()
    # Only pods that run kvguard may reach it.
    policy = find(resources, "NetworkPolicy", url.hostname or "")
    (rule,) = policy["spec"]["ingress"]
    allowed = rule["from"][0]["podSelector"]["matchLabels"]
    assert allowed.items() <= pod_spec_labels(host("base")).items()


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_replicas_are_counted_from_the_pods_that_run_kvguard(name: str) -> None:
    """ledger.replicas: auto counts the ready pods of replica_service: a headless Service that
    selects exactly the pods kvguard is injected into, whichever they are."""
    resources = build(name)
    ledger = kvguard_config(resources).ledger
    assert ledger.replicas == "auto"
    assert ledger.replica_service is not None
    service = find(resources, "Service", ledger.replica_service)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is False  # ready pods only
    (port,) = service["spec"]["ports"]
    assert (port["name"], port["port"]) == ("kvguard-grpc", kvguard_port(resources))
    selector = service["spec"]["selector"].items()
    selected = [
        (w["kind"], w["metadata"]["name"])
        for w in of_kind(resources, "Deployment") + of_kind(resources, "StatefulSet")
        if selector <= pod_spec_labels(w).items()
    ]
    assert selected == [SIDECAR_HOSTS[name]]


def test_external_redis_comes_from_a_secret() -> None:
    resources = build("overlays/external-redis")
    assert not [r for r in resources if r["metadata"]["name"] == "kvguard-redis"]
    env = container(host("overlays/external-redis"), "kvguard")["env"]
    assert env == [
        {
            "name": "KVGUARD_LEDGER_URL",
            "valueFrom": {"secretKeyRef": {"name": "kvguard-ledger", "key": "url"}},
        }
    ]
    # ...and that variable is the override kvguard reads for ledger.url.
    text = find(resources, "ConfigMap", "kvguard-config")["data"]["kvguard.yaml"]
    config = configs.parse(
        text, "kvguard.yaml", environ={"KVGUARD_LEDGER_URL": "rediss://r:6380/0"}
    )
    assert config.ledger.url == "rediss://r:6380/0"


# How each kustomization knows the tenant: Envoy's jwt_authn (components/jwt-identity), Istio's
# RequestAuthentication, kvguard's own map of API keys, or nobody (every request on the default
# tier). Each is complete as shipped: no placeholder issuer where no JWT is verified.
IDENTITIES = {
    "base": "none",
    "overlays/sample-vllm": "jwt",
    "overlays/existing-vllm": "api_key",
    "overlays/external-redis": "jwt",
    "overlays/istio-gateway": "istio",
    "overlays/istio-sidecar": "istio",
}


def test_every_kustomization_says_how_it_identifies_tenants() -> None:
    assert set(IDENTITIES) == set(KUSTOMIZATIONS)


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_tenant_header_is_stripped_from_clients_first(name: str) -> None:
    """Whoever sets tenancy.header, the client's own copy is removed before anything reads it."""
    resources = build(name)
    header = kvguard_config(resources).tenancy.header
    for envoy in envoy_configs(resources):
        first = http_filters(envoy)[0]
        assert first["name"] == "envoy.filters.http.header_mutation"
        assert first["typed_config"]["mutations"]["request_mutations"] == [{"remove": header}]
    strip = [
        p
        for f in of_kind(resources, "EnvoyFilter")
        for p in f["spec"]["configPatches"]
        if p["applyTo"] == "HTTP_FILTER" and "header_mutation" in str(p["patch"]["value"])
    ]
    for patch in strip:
        mutations = patch["patch"]["value"]["typed_config"]["mutations"]["request_mutations"]
        assert mutations == [{"remove": header}]
    assert [p["patch"]["operation"] for p in strip] == (
        ["INSERT_FIRST"] if IDENTITIES[name] == "istio" else []
    )
    assert len(envoy_configs(resources)) + len(strip) == 1


@pytest.mark.parametrize("name", [n for n, how in IDENTITIES.items() if how == "jwt"])
def test_a_jwt_gateway_sets_the_header_from_a_verified_token_only(name: str) -> None:
    resources = build(name)
    tenancy = kvguard_config(resources).tenancy
    assert tenancy.identity == "header"
    files = envoy_files(resources)
    jwt = slot_filter(files, IDENTITY)
    assert jwt["@type"] == JWT_AUTHN
    clusters = {c["name"] for c in extra_clusters(files)}
    assert jwt["providers"]
    for provider in jwt["providers"].values():
        assert provider["issuer"]
        assert provider["remote_jwks"]["http_uri"]["cluster"] in clusters
        assert [c["header_name"] for c in provider["claim_to_headers"]] == [tenancy.header]
        assert provider["forward"] is False  # vLLM never sees the token
    assert jwt["rules"] and all("requires" in rule for rule in jwt["rules"])


@pytest.mark.parametrize("name", [n for n, how in IDENTITIES.items() if how in ("none", "api_key")])
def test_without_a_token_verifier_no_issuer_is_deployed(name: str) -> None:
    """No JWT filter, no identity provider's address, no placeholder that would answer every
    request 401: kvguard's tenancy alone decides."""
    resources = build(name)
    tenancy = kvguard_config(resources).tenancy
    files = envoy_files(resources)
    assert slot_filter(files, IDENTITY) == {"@type": HEADER_MUTATION, "mutations": {}}
    assert extra_clusters(files) == []
    assert of_kind(resources, "RequestAuthentication") == []
    assert "auth.example.com" not in yaml.safe_dump_all(resources)
    if IDENTITIES[name] == "none":  # nobody sets the header: every request on the default tier
        assert tenancy.identity == "header" and tenancy.default_tier is not None
    else:  # the client's own API key, mapped by kvguard; unknown keys are refused
        assert tenancy.identity == "api_key" and tenancy.default_tier is None


@pytest.mark.parametrize("name", [n for n, how in IDENTITIES.items() if how == "istio"])
def test_istio_sets_the_header_from_a_required_token(name: str) -> None:
    resources = build(name)
    tenancy = kvguard_config(resources).tenancy
    assert tenancy.identity == "header"
    (authn,) = of_kind(resources, "RequestAuthentication")
    for rule in authn["spec"]["jwtRules"]:
        assert rule["issuer"]
        assert [h["header"] for h in rule["outputClaimToHeaders"]] == [tenancy.header]
        assert rule["forwardOriginalToken"] is False
    # RequestAuthentication alone lets token-less requests in: a policy must require one.
    policies = of_kind(resources, "AuthorizationPolicy")
    assert any(
        source["source"].get("requestPrincipals") == ["*"]
        and p["spec"]["selector"] == authn["spec"]["selector"]
        for p in policies
        for rule in p["spec"]["rules"]
        for source in rule.get("from", [])
    )


@pytest.mark.parametrize("name", ISTIO)
def test_envoy_filters_select_the_injected_pods(name: str) -> None:
    resources = build(name)
    labels = pod_spec_labels(host(name))
    for envoy_filter in of_kind(resources, "EnvoyFilter"):
        assert envoy_filter["spec"]["workloadSelector"]["labels"].items() <= labels.items()
        contexts = {p["match"]["context"] for p in envoy_filter["spec"]["configPatches"]}
        expected = (
            {"GATEWAY"}
            if name.endswith("gateway")
            else {
                "SIDECAR_INBOUND",
                "SIDECAR_OUTBOUND",
            }
        )
        assert contexts == expected
    for authn in of_kind(resources, "RequestAuthentication"):
        assert authn["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_sidecar_envoy_filter_targets_vllms_port() -> None:
    resources = build("overlays/istio-sidecar")
    port = container(find(resources, "StatefulSet", "vllm-qwen"), "vllm")["ports"][0]
    ports = {
        p["match"].get("listener", {}).get("portNumber")
        or p["match"].get("cluster", {}).get("portNumber")
        for f in of_kind(resources, "EnvoyFilter")
        for p in f["spec"]["configPatches"]
        if p["match"]["context"] == "SIDECAR_INBOUND"
    } - {None}
    assert ports == {port["containerPort"]}


def test_vllm_is_configured_as_the_design_says() -> None:
    resources = build("overlays/sample-vllm")
    config = kvguard_config(resources)
    (pool,) = config.pools
    statefulset = find(resources, "StatefulSet", f"vllm-{pool.name}")
    vllm = container(statefulset, "vllm")
    assert vllm["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(arg.removeprefix("--").partition("=")[::2] for arg in vllm["args"])
    assert flags["gpu-memory-utilization"] == "0.90"
    assert int(flags["max-model-len"]) == pool.max_model_len
    assert "enable-prefix-caching" in flags
    gpus = vllm["resources"]["limits"]["nvidia.com/gpu"]
    assert int(flags["tensor-parallel-size"]) == int(gpus) >= 1
    assert flags["served-model-name"] in pool.models
    # The tokenizer kvguard counts with is the model vLLM serves, from the same volume.
    assert pool.tokenizer == flags["model"]
    assert int(flags["port"]) in {p["containerPort"] for p in vllm["ports"]}
    # The gateway's one name for the pool selects these pods and governs the StatefulSet.
    service = upstream_service(resources)
    assert service["spec"]["selector"].items() <= pod_spec_labels(statefulset).items()
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    assert upstream_port(resources) == int(flags["port"])
    # The ClusterIP Service for routing inside a mesh selects them too.
    mesh = find(resources, "Service", f"vllm-{pool.name}")
    assert mesh["spec"]["selector"].items() <= pod_spec_labels(statefulset).items()


@pytest.mark.parametrize("name", PLAIN_GATEWAYS)
def test_gateway_routes_to_and_meters_the_same_pods(name: str) -> None:
    """Envoy's `vllm` cluster and kvguard's capacity discovery name one headless Service, so
    the pods that get the requests are the pods whose blocks are counted."""
    resources = build(name)
    (envoy,) = envoy_configs(resources)
    vllm_cluster = cluster(envoy, "vllm")
    assert vllm_cluster["type"] == "STRICT_DNS"  # every address of the name, refreshed
    (locality,) = vllm_cluster["load_assignment"]["endpoints"]
    (endpoint,) = locality["lb_endpoints"]
    service = upstream_service(resources)
    assert endpoint["endpoint"]["address"]["socket_address"] == {
        "address": service["metadata"]["name"],
        "port_value": upstream_port(resources),
    }
    spec = service["spec"]
    assert spec["clusterIP"] == "None"  # one record per pod, not one virtual IP
    assert spec["publishNotReadyAddresses"] is False  # no traffic to a pod still loading
    # Headless: no port translation, so the Service states the port clients use.
    port = upstream_port(resources)
    assert [(p["port"], p["targetPort"]) for p in spec["ports"]] == [(port, port)]


@pytest.mark.parametrize("name", ["base", "overlays/existing-vllm"])
def test_gateway_alone_deploys_no_vllm_and_no_model_volume(name: str) -> None:
    resources = build(name)
    assert of_kind(resources, "StatefulSet") == []
    assert of_kind(resources, "PersistentVolumeClaim") == []
    images = [c["image"] for w in workloads(resources) for c in all_containers(w)]
    assert not [image for image in images if "vllm" in image]
    volumes = [v for w in workloads(resources) for v in pod_spec(w)["volumes"]]
    assert not [v for v in volumes if "persistentVolumeClaim" in v]
    # What the gateway routes to is the one Service it owns, selecting pods it does not deploy.
    selector = upstream_service(resources)["spec"]["selector"].items()
    assert not [w for w in workloads(resources) if selector <= pod_spec_labels(w).items()]


def test_sample_vllm_adds_the_pool_and_its_model_store() -> None:
    base, sample = build("base"), build("overlays/sample-vllm")

    def names(resources: tuple[Resource, ...]) -> set[tuple[str, str]]:
        # Envoy's ConfigMap by its name without the content hash: jwt-identity changes it.
        return {
            (r["kind"], re.sub(r"^(kvguard-gateway-envoy)-\w+$", r"\1", r["metadata"]["name"]))
            for r in resources
        }

    added = names(sample) - names(base)
    assert added == {
        ("StatefulSet", "vllm-qwen"),
        ("Service", "vllm-qwen"),
        ("ServiceAccount", "vllm"),
        ("PersistentVolumeClaim", "model-store"),
    }
    # kvguard reads the tokenizer from the model store instead of fetching it.
    gateway = find(sample, "Deployment", "kvguard-gateway")
    assert [c["name"] for c in pod_spec(gateway)["initContainers"]] == ["kvguard"]
    (models,) = [v for v in pod_spec(gateway)["volumes"] if v["name"] == "kvguard-models"]
    assert models == {
        "name": "kvguard-models",
        "persistentVolumeClaim": {"claimName": "model-store", "readOnly": True},
    }


def test_existing_vllm_selects_the_users_pods_in_their_namespace() -> None:
    resources = build("overlays/existing-vllm")
    edited = yaml.safe_load_all((K8S / "overlays/existing-vllm/vllm.yaml").read_text())
    (patch,) = [d for d in edited if d["kind"] == "Service"]
    wanted = {k: v for k, v in patch["spec"]["selector"].items() if k != "$patch"}
    # Exactly the user's labels: none of the base's is left to narrow the selection.
    assert upstream_service(resources)["spec"]["selector"] == wanted
    namespace = yaml.safe_load((K8S / "overlays/existing-vllm/kustomization.yaml").read_text())
    assert {r["metadata"].get("namespace") for r in resources} == {namespace["namespace"]}


def test_vllm_in_another_namespace_is_an_alias(tmp_path: Path) -> None:
    """overlays/existing-vllm's commented alternative, uncommented, builds into an ExternalName
    Service under the same name (a CNAME to the user's headless Service), with the edits
    vllm.yaml lists for it: the kustomization's replacements go, and so does the NetworkPolicy
    (it protects the pods of its own namespace only)."""
    overlay = tmp_path / "k8s" / "overlays" / "existing-vllm"
    shutil.copytree(K8S, tmp_path / "k8s")
    text = (overlay / "vllm.yaml").read_text()
    documents = text.split("\n---\n")
    block = documents[0].split("# --- another namespace ---\n")[1].split("# --- end ---")[0]
    alias = "\n".join(line.removeprefix("# ") for line in block.splitlines())
    (overlay / "vllm.yaml").write_text("\n---\n".join([alias, *documents[1:]]))
    kustomization = (overlay / "kustomization.yaml").read_text()
    assert "replacements:" in kustomization
    head, _, replacements = kustomization.partition("\nreplacements:\n")
    assert all(line.startswith(("- ", "  ")) for line in replacements.splitlines())  # the last key
    (overlay / "kustomization.yaml").write_text(head + "\n")
    resources = tuple(kustomize(overlay))
    spec = upstream_service(resources)["spec"]
    assert spec["type"] == "ExternalName" and spec["externalName"].endswith(".svc.cluster.local")
    assert "selector" not in spec and "clusterIP" not in spec
    assert [p["metadata"]["name"] for p in of_kind(resources, "NetworkPolicy")] == [
        "kvguard-gateway",
        "kvguard-redis",
    ]
    for resource in resources:
        validate(resource)


def test_existing_vllm_takes_an_external_redis(tmp_path: Path) -> None:
    """overlays/existing-vllm's commented components, external-redis uncommented."""
    overlay = tmp_path / "k8s" / "overlays" / "existing-vllm"
    shutil.copytree(K8S, tmp_path / "k8s")
    text = (overlay / "kustomization.yaml").read_text()
    for line in ("# components:", "# - ../../components/external-redis"):
        assert line in text
        text = text.replace(line, line.removeprefix("# "))
    (overlay / "kustomization.yaml").write_text(text)
    resources = tuple(kustomize(overlay))
    assert not [r for r in resources if r["metadata"]["name"] == "kvguard-redis"]
    env = container(find(resources, "Deployment", "kvguard-gateway"), "kvguard")["env"]
    assert [e["name"] for e in env] == ["KVGUARD_LEDGER_URL"]
    for resource in resources:
        validate(resource)


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_mount_and_claim_exists(name: str) -> None:
    resources = build(name)
    claims = {c["metadata"]["name"] for c in of_kind(resources, "PersistentVolumeClaim")}
    for workload in workloads(resources):
        volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
        for each in all_containers(workload):
            for mount in each.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{each['name']}: no volume {mount['name']}"
        for volume in volumes.values():
            assert len(volume) == 2, f"{volume['name']}: one source, not {sorted(volume)}"
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims


TOKENIZER_FETCHERS = [
    name
    for name in KUSTOMIZATIONS
    if any(c["name"] == "kvguard-tokenizer" for c in pod_spec(host(name)).get("initContainers", []))
]


def test_the_gateway_alone_fetches_the_tokenizer() -> None:
    assert TOKENIZER_FETCHERS == ["base", "overlays/existing-vllm"]


@pytest.mark.parametrize("name", TOKENIZER_FETCHERS)
def test_tokenizer_is_fetched_into_the_pools_folder_before_kvguard_starts(name: str) -> None:
    resources = build(name)
    (pool,) = kvguard_config(resources).pools
    workload = host(name)
    # A regular init container before the native sidecar: it has finished when kvguard starts.
    names = [c["name"] for c in pod_spec(workload)["initContainers"]]
    assert names == ["kvguard-tokenizer", "kvguard"]
    fetcher = container(workload, "kvguard-tokenizer")
    assert "restartPolicy" not in fetcher
    env = {e["name"]: e.get("value") for e in fetcher["env"]}
    assert fetcher["command"] == ["hf"] and fetcher["args"][:2] == ["download", "$(MODEL_REPO)"]
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(fetcher["args"])
    expanded = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in fetcher["args"]]
    assert f"--local-dir={pool.tokenizer}" in expanded
    assert re.fullmatch(r"[0-9a-f]{40}", env["MODEL_REVISION"])  # a commit, not a branch
    # It writes the folder that kvguard, in the same image, then reads (read-only).
    assert fetcher["image"] == container(workload, "kvguard")["image"]
    writes = mount_of(fetcher, pool.tokenizer)
    reads = mount_of(container(workload, "kvguard"), pool.tokenizer)
    assert writes["name"] == reads["name"] and reads.get("readOnly") is True
    assert fetcher["securityContext"] == container(workload, "kvguard")["securityContext"]


def mount_of(each: dict[str, Any], path: str) -> dict[str, Any]:
    """The mount of `each` that holds `path`."""
    mounts: list[dict[str, Any]] = each["volumeMounts"]
    (mount,) = [m for m in mounts if Path(path).is_relative_to(m["mountPath"])]
    return mount


def test_the_image_has_the_hf_command() -> None:
    """kvguard-tokenizer runs `hf` from kvguard's image: huggingface_hub is in its lock."""
    lock = (ROOT / "requirements.lock").read_text()
    assert re.search(r"^huggingface-hub==", lock, re.MULTILINE)
    scripts = importlib.metadata.distribution("huggingface_hub").entry_points
    assert "hf" in {e.name for e in scripts if e.group == "console_scripts"}


@pytest.mark.parametrize("name", PLAIN_GATEWAYS)
def test_gateway_egress_is_what_its_containers_need(name: str) -> None:
    resources = build(name)
    policy = find(resources, "NetworkPolicy", "kvguard-gateway")
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    allowed = {
        (p["port"], p["protocol"]) for rule in policy["spec"]["egress"] for p in rule["ports"]
    }
    ledger = urllib.parse.urlsplit(kvguard_config(resources).ledger.url).port
    needed = {(53, "UDP"), (53, "TCP"), (upstream_port(resources), "TCP"), (ledger, "TCP")}
    # The identity provider's JWKS (Envoy) and the Hugging Face Hub (kvguard-tokenizer).
    for extra in extra_clusters(envoy_files(resources)):
        (locality,) = extra["load_assignment"]["endpoints"]
        for endpoint in locality["lb_endpoints"]:
            needed.add((endpoint["endpoint"]["address"]["socket_address"]["port_value"], "TCP"))
    if name in TOKENIZER_FETCHERS:
        needed.add((443, "TCP"))
    assert needed <= allowed
    # external-redis: rediss:// as well; 443 stays open for a JWKS or Hub that comes later.
    assert allowed - needed <= {(6380, "TCP"), (443, "TCP")}


def test_gateway_service_targets_the_gateway_listener() -> None:
    resources = build("base")
    (gateway,) = envoy_configs(resources)
    deployment = find(resources, "Deployment", "kvguard-gateway")
    (envoy,) = deployment["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in envoy["ports"]}
    assert ports["http"] == listener(gateway)["address"]["socket_address"]["port_value"]
    health = listener(gateway, "health")["address"]["socket_address"]["port_value"]
    assert ports[envoy["readinessProbe"]["httpGet"]["port"]] == health
    service = find(resources, "Service", "kvguard-gateway")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    policy = find(resources, "NetworkPolicy", "kvguard-gateway")
    allowed = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert ports["http"] in allowed and 50051 not in allowed


def test_shipped_policy_builds_with_a_real_tokenizer() -> None:
    """What `kvguard check-config` does, with the pool's tokenizer folder taken from the test
    cache (in the pod it is the model folder on the model-store volume)."""
    config = kvguard_config(build("base"))
    pools = [p.model_copy(update={"tokenizer": str(model_dir("qwen"))}) for p in config.pools]
    built = policy.build(config.model_copy(update={"pools": pools}))
    assert set(built.pools) == {"qwen"}
