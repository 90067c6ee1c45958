"""overlays/existing-vllm works with the edits its kustomization lists, in its own folder, and no
others: the image from its `images:` block, its own policy in place of the base's, tenants by
their API keys (no identity provider to set up), and vLLM's --api-key from a Secret."""

from __future__ import annotations

import hashlib
import re
import tomllib
from collections.abc import Callable

import pytest
import yaml

from kvguard import config as configs
from kvguard.admission import policy
from kvguard.errors import Code, Refusal
from tests.conftest import model_dir
from tests.deploy.envoy_files import (
    CREDENTIAL,
    CREDENTIAL_INJECTOR,
    edited_build,
    envoy_files,
    slot_filter,
    uncommented,
)
from tests.deploy.manifests import K8S, ROOT, Resource, build, container, find, validate
from tests.deploy.workloads import (
    all_containers,
    kvguard_config,
    upstream_service,
    workloads,
)

OVERLAY = "overlays/existing-vllm"
FOLDER = K8S / OVERLAY
# The containers that run the kvguard image (the sidecar and its tokenizer download).
KVGUARD_IMAGE_CONTAINERS = {"kvguard", "kvguard-tokenizer"}
TENANT_KEY = "sk-acme-0123456789abcdef"


def images(resources: tuple[Resource, ...]) -> dict[str, set[str]]:
    """Container name -> the images it runs, over every workload."""
    found: dict[str, set[str]] = {}
    for workload in workloads(resources):
        for each in all_containers(workload):
            found.setdefault(each["name"], set()).add(each["image"])
    return found


def test_the_images_block_names_the_image_you_pushed() -> None:
    (entry,) = yaml.safe_load((FOLDER / "kustomization.yaml").read_text())["images"]
    assert entry["name"] == "kvguard"
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert entry["newTag"] == version  # the tag docs/deployment.md builds
    shipped = images(build(OVERLAY))
    for name in KVGUARD_IMAGE_CONTAINERS:
        assert shipped[name] == {f"{entry['newName']}:{entry['newTag']}"}


def test_the_image_is_set_by_the_images_block() -> None:
    def edit(text: str) -> str:
        old = "  newName: registry.example.com/kvguard  # EDIT: where you pushed the image\n"
        assert old in text
        text = text.replace(old, "  newName: registry.internal/ml/kvguard\n")
        return text.replace("  newTag: 0.1.0 ", "  newTag: 0.1.0-rc1 ")

    edited = images(edited_build(OVERLAY, {"kustomization.yaml": edit}))
    shipped = images(build(OVERLAY))
    for name, found in edited.items():
        if name in KVGUARD_IMAGE_CONTAINERS:
            assert found == {"registry.internal/ml/kvguard:0.1.0-rc1"}
        else:
            assert found == shipped[name]  # Envoy's and Redis's images untouched


def test_the_overlays_policy_replaces_the_bases() -> None:
    resources = build(OVERLAY)
    config_maps = [r for r in resources if r["metadata"]["name"].startswith("kvguard-config")]
    (config_map,) = config_maps  # the same name as the base's, which the pod mounts
    assert config_map["metadata"]["name"] == "kvguard-config"
    text = config_map["data"]["kvguard.yaml"]
    assert text == (FOLDER / "kvguard.yaml").read_text()
    assert text != (K8S / "base" / "kvguard.yaml").read_text()
    gateway = find(resources, "Deployment", "kvguard-gateway")
    volumes = gateway["spec"]["template"]["spec"]["volumes"]
    assert {"name": "kvguard-config", "configMap": {"name": "kvguard-config"}} in volumes


def test_as_shipped_the_policy_asks_for_its_tenants_keys() -> None:
    """No identity to set up but the policy's own keys: until they are listed, check-config
    says every request gets 401 (and why), and no key is let through."""
    config = kvguard_config(build(OVERLAY))
    assert (config.tenancy.identity, config.tenancy.default_tier) == ("api_key", None)
    assert policy.warnings(config) == [
        "tenancy: no default_tier and no tenants: every request gets 401 unknown_tenant"
    ]


def listed_edits(namespace: str, labels: dict[str, str]) -> dict[str, Callable[[str], str]]:
    """Every edit the overlay's kustomization lists, as a user makes them, by file."""
    digest = hashlib.sha256(TENANT_KEY.encode()).hexdigest()

    def kustomization_edit(text: str) -> str:
        text = replace(text, "namespace: llm  #", f"namespace: {namespace}  #")
        text = replace(
            text,
            "newName: registry.example.com/kvguard  #",
            "newName: registry.internal/kvguard  #",
        )
        return uncommented(text, "# components:", "# - ../../components/vllm-api-key")

    def vllm_edit(text: str) -> str:
        text = replace(
            text,
            "    app: vllm  # EDIT: your vLLM pods' labels\n",
            "".join(f"    {key}: {value}\n" for key, value in labels.items()),
        )
        text = replace(text, "value: Qwen/Qwen2.5-7B-Instruct}", "value: acme/model-7b}")
        return replace(text, "value: /models/qwen2.5-7b-instruct}", "value: /models/model-7b}")

    def policy_edit(text: str) -> str:
        text = replace(text, "  api_keys: {}\n", f'  api_keys: {{"{digest}": acme}}\n')
        text = replace(text, "  tenants: {}  #", "  tenants: {acme: pro}  #")
        text = replace(text, "models: [qwen2.5-7b-instruct]", "models: [model-7b]")
        text = replace(
            text, "tokenizer: /models/qwen2.5-7b-instruct", "tokenizer: /models/model-7b"
        )
        return replace(text, "max_model_len: 32768", "max_model_len: 8192")

    return {
        "kustomization.yaml": kustomization_edit,
        "vllm.yaml": vllm_edit,
        "kvguard.yaml": policy_edit,
    }


def replace(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"{old!r} is not once in the file"
    return text.replace(old, new)


def test_it_deploys_with_only_its_listed_edits() -> None:
    """Each edit the header lists, in the overlay's own files (k8s/base and the components as
    shipped): the build validates and does what each edit asked."""
    labels = {"app.kubernetes.io/name": "vllm-7b"}
    resources = edited_build(OVERLAY, listed_edits("inference", labels))
    for resource in resources:
        validate(resource)
    assert {r["metadata"].get("namespace") for r in resources} == {"inference"}
    # Routed to, metered and protected: the user's pods.
    assert upstream_service(resources)["spec"]["selector"] == labels
    protected = find(resources, "NetworkPolicy", "kvguard-vllm")["spec"]["podSelector"]
    assert protected == {"matchLabels": labels}
    # The image pushed; the tokenizer fetched into the pool's folder.
    assert images(resources)["kvguard"] == {"registry.internal/kvguard:0.1.0"}
    config = kvguard_config(resources)
    (pool,) = config.pools
    gateway = find(resources, "Deployment", "kvguard-gateway")
    fetcher = {e["name"]: e.get("value") for e in container(gateway, "kvguard-tokenizer")["env"]}
    assert (fetcher["MODEL_REPO"], fetcher["TOKENIZER_DIR"]) == ("acme/model-7b", pool.tokenizer)
    # vLLM's --api-key: Envoy injects it from the Secret.
    assert slot_filter(envoy_files(resources), CREDENTIAL)["@type"] == CREDENTIAL_INJECTOR
    # The policy admits the tenant's key and nothing else, with nothing left to warn about.
    assert policy.warnings(config) == []
    loaded = policy.build(
        config.model_copy(
            update={"pools": [pool.model_copy(update={"tokenizer": str(model_dir("qwen"))})]}
        )
    )
    identity = policy.identify_request(loaded, {"authorization": f"Bearer {TENANT_KEY}"})
    assert (identity.tenant, identity.tier_name) == ("acme", "pro")
    for headers in ({"authorization": "Bearer sk-guessed"}, {"x-tenant-id": "acme"}, {}):
        with pytest.raises(Refusal) as refused:
            policy.identify_request(loaded, headers)
        assert refused.value.code == Code.UNKNOWN_TENANT


def test_the_listed_edits_are_the_ones_its_header_lists() -> None:
    """The header of the kustomization numbers each edit and names its file; every EDIT mark
    of the overlay's files is in a file it names."""
    header = (FOLDER / "kustomization.yaml").read_text().split("apiVersion:")[0]
    steps = re.findall(r"^#\s+(\d)\. ", header, re.MULTILINE)
    assert steps == ["1", "2", "3", "4", "5"]
    named = {"kustomization.yaml", "vllm.yaml", "kvguard.yaml"}
    for path in FOLDER.iterdir():
        if "EDIT" in path.read_text():
            assert path.name in named
    for name in ("vllm.yaml", "kvguard.yaml"):
        assert name in header
    assert configs.parse((FOLDER / "kvguard.yaml").read_text(), "kvguard.yaml", environ={})
