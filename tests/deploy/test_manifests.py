"""Every file under k8s/ parses, every kustomization builds with a real kubectl (kustomize), and
every resource it produces validates against the strict schema of its kind, offline."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.manifests import (
    K8S,
    KUSTOMIZATIONS,
    PICKERS,
    build,
    container,
    find,
    kustomize,
    of_kind,
    pod_spec,
    validate,
    yaml_files,
)


@pytest.mark.parametrize("path", list(yaml_files()), ids=lambda p: str(p.relative_to(K8S)))
def test_every_yaml_file_parses(path: Path) -> None:
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert documents, f"{path} holds no document"
    assert all(isinstance(d, dict) for d in documents)


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_kustomization_builds_and_validates(name: str) -> None:
    resources = build(name)
    assert resources
    for resource in resources:
        try:
            validate(resource)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
            pytest.fail(f"{name}: {resource['kind']}/{resource['metadata']['name']}: {exc}")
    names = [(r["kind"], r["metadata"]["name"]) for r in resources]
    assert len(names) == len(set(names)), "a resource appears twice"


def test_every_manifest_is_part_of_a_kustomization() -> None:
    """No file is left out of every build (it would never be validated, nor deployed)."""
    referenced: set[Path] = set()
    for path in yaml_files():
        if path.name != "kustomization.yaml":
            continue
        spec = yaml.safe_load(path.read_text())
        for entry in spec.get("resources", []):
            referenced.add((path.parent / entry).resolve())
        for patch in spec.get("patches", []):
            if "path" in patch:
                referenced.add((path.parent / patch["path"]).resolve())
        for generator in spec.get("configMapGenerator", []):
            for entry in generator.get("files", []):
                referenced.add((path.parent / entry.split("=", 1)[-1]).resolve())
    kustomizations = {p for p in yaml_files() if p.name == "kustomization.yaml"}
    assert set(yaml_files()) - kustomizations - referenced == set()


def test_every_kustomization_is_built_here() -> None:
    """A kustomization a user can apply (not a Component) is in KUSTOMIZATIONS, so that every
    test above builds and checks it, or in PICKERS (test_inference_pool.py)."""
    applicable = {
        str(path.parent.relative_to(K8S))
        for path in yaml_files()
        if path.name == "kustomization.yaml"
        and yaml.safe_load(path.read_text())["kind"] == "Kustomization"
    }
    assert applicable == set(KUSTOMIZATIONS) | set(PICKERS)


def test_validation_refuses_an_unknown_field() -> None:
    deployment = copy.deepcopy(find(build("base"), "Deployment", "kvguard-gateway"))
    container(deployment, "kvguard")["readinesProbe"] = {"grpc": {"port": 50051}}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)


def test_validation_refuses_a_wrong_istio_field() -> None:
    envoy_filter = copy.deepcopy(of_kind(build("overlays/istio-gateway"), "EnvoyFilter")[0])
    envoy_filter["spec"]["configPatches"][0]["match"]["context"] = "INGRESS"
    with pytest.raises(jsonschema.ValidationError):
        validate(envoy_filter)
    envoy_filter = copy.deepcopy(of_kind(build("overlays/istio-gateway"), "EnvoyFilter")[0])
    envoy_filter["spec"]["workloadSelctor"] = {}
    with pytest.raises(jsonschema.ValidationError):
        validate(envoy_filter)


def test_component_injects_only_the_labelled_workload(tmp_path: Path) -> None:
    """components/kvguard-sidecar into workloads of another kustomization, chosen by label."""
    app = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "spec": {
            "selector": {"matchLabels": {"app": "x"}},
            "template": {
                "metadata": {"labels": {"app": "x"}},
                "spec": {"containers": [{"name": "proxy", "image": "envoyproxy/envoy:v1.40.0"}]},
            },
        },
    }
    chosen = copy.deepcopy(app) | {
        "metadata": {"name": "chosen", "labels": {"kvguard.io/inject": "true"}}
    }
    other = copy.deepcopy(app) | {"metadata": {"name": "other"}}
    (tmp_path / "workloads.yaml").write_text(yaml.safe_dump_all([chosen, other]))
    component = Path(
        *[".."] * len(tmp_path.resolve().parts[1:]), *(K8S / "components/kvguard-sidecar").parts[1:]
    )
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump({"resources": ["workloads.yaml"], "components": [str(component)]})
    )
    built = kustomize(tmp_path)
    injected, untouched = find(built, "Deployment", "chosen"), find(built, "Deployment", "other")
    sidecar = container(injected, "kvguard")
    assert sidecar["restartPolicy"] == "Always"
    assert [c["name"] for c in pod_spec(injected)["containers"]] == ["proxy"]
    assert "initContainers" not in pod_spec(untouched)
    for resource in built:
        validate(resource)


def test_a_broken_kustomization_fails_the_build(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: [missing.yaml]\n")
    with pytest.raises(subprocess.CalledProcessError) as caught:
        kustomize(tmp_path)
    assert "missing.yaml" in caught.value.stderr
