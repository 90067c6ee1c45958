"""The gateway's Envoy as a kustomization ships it: the ConfigMap kvguard-gateway-envoy holds
envoy.yaml and the files Envoy discovers at run time (the two chosen filters, the clusters they
need, the vLLM key's secret), mounted at /etc/envoy.

`static_form` inlines those files into one bootstrap, for reading and for `envoy --mode
validate` (which does not read discovered files). `localized` writes them to a folder with
their paths pointed there, and `on_loopback` renders them for a real Envoy that discovers them
as the pod's does; `KubeletSecret` writes a Secret's folder the way the kubelet does (a
`..data` link swapped on each update). `build_variant` builds a shipped kustomization, or
overlays/existing-vllm with its optional vllm-api-key component.
"""

from __future__ import annotations

import copy
import functools
import itertools
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from kvguard.testing.envoy import http_filters, listener, render_envoy_config
from tests.deploy.manifests import K8S, Resource, build, find, kustomize, of_kind

ENVOY_CONFIGMAP = "kvguard-gateway-envoy"
ENVOY_MOUNT = "/etc/envoy"
SECRET_MOUNT = "/etc/kvguard-vllm"  # components/vllm-api-key
IDENTITY = "kvguard.identity"
CREDENTIAL = "kvguard.upstream_credential"
SLOT_FILES = {IDENTITY: "identity.yaml", CREDENTIAL: "upstream-credential.yaml"}
CLUSTERS_FILE = "clusters.yaml"
HEADER_MUTATION = (
    "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation"
)
JWT_AUTHN = "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication"
CREDENTIAL_INJECTOR = (
    "type.googleapis.com/envoy.extensions.filters.http.credential_injector.v3.CredentialInjector"
)


def envoy_files(resources: tuple[Resource, ...] | list[Resource]) -> dict[str, str]:
    """The files of the gateway's Envoy ConfigMap (its name carries a content hash)."""
    (config_map,) = [
        cm
        for cm in of_kind(resources, "ConfigMap")
        if cm["metadata"]["name"].startswith(ENVOY_CONFIGMAP + "-")
    ]
    data: dict[str, str] = config_map["data"]
    return data


def slot_filter(files: Mapping[str, str], slot: str) -> dict[str, Any]:
    """The `typed_config` (with its "@type") of the filter that fills `slot`: the one resource
    of its file, named as the slot."""
    document = yaml.safe_load(files[SLOT_FILES[slot]])
    (resource,) = document["resources"]
    assert resource["@type"] == "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig"
    assert resource["name"] == slot
    typed_config: dict[str, Any] = resource["typed_config"]
    return typed_config


def extra_clusters(files: Mapping[str, str]) -> list[dict[str, Any]]:
    """The clusters of clusters.yaml, without their "@type"."""
    resources = yaml.safe_load(files[CLUSTERS_FILE])["resources"]
    assert all(
        r["@type"] == "type.googleapis.com/envoy.config.cluster.v3.Cluster" for r in resources
    )
    return [{k: v for k, v in r.items() if k != "@type"} for r in resources]


def static_form(files: Mapping[str, str]) -> dict[str, Any]:
    """envoy.yaml with each discovered filter in its slot and clusters.yaml's clusters beside
    its own, as one static bootstrap."""
    config: dict[str, Any] = yaml.safe_load(files["envoy.yaml"])
    filters = http_filters(config)
    for index, entry in enumerate(filters):
        if entry["name"] in SLOT_FILES:
            assert set(entry) == {"name", "config_discovery"}, entry["name"]
            filters[index] = {
                "name": entry["name"],
                "typed_config": slot_filter(files, entry["name"]),
            }
    config["static_resources"]["clusters"] += extra_clusters(files)
    del config["dynamic_resources"]
    return config


def localized(files: Mapping[str, str], folder: Path, secret: Path | None = None) -> dict[str, str]:
    """The files written to `folder`, every /etc/envoy path in them (and /etc/kvguard-vllm, as
    `secret`) pointed at those copies; returns what was written."""
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, text in files.items():
        local = text.replace(ENVOY_MOUNT + "/", f"{folder}/")
        if secret is not None:
            local = local.replace(SECRET_MOUNT, str(secret))
        (folder / name).write_text(local)
        written[name] = local
    return written


def on_loopback(
    files: Mapping[str, str],
    folder: Path,
    *,
    kvguard_port: int,
    upstream_port: int,
    secret: Path | None = None,
) -> dict[str, Any]:
    """`localized` files, and their envoy.yaml rendered on loopback: the listeners on ports the
    kernel chooses, the `kvguard` and `vllm` clusters on these ports."""
    localized(files, folder, secret)
    config = render_envoy_config(
        folder / "envoy.yaml",
        listen_port=0,
        admin_port=0,
        kvguard_port=kvguard_port,
        upstream_port=upstream_port,
    )
    health = listener(config, "health")["address"]["socket_address"]
    health.update(address="127.0.0.1", port_value=0)
    return config


def envoy_args(resources: tuple[Resource, ...] | list[Resource]) -> list[str]:
    """The options the gateway pod gives Envoy besides its config, concurrency, log level and
    hot restart (which EnvoyProcess sets itself)."""
    deployment = find(resources, "Deployment", "kvguard-gateway")
    (envoy,) = [
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "envoy"
    ]
    args: list[str] = []
    given = iter(envoy["args"])
    for arg in given:
        if arg in ("--config-path", "--concurrency", "--log-level"):
            next(given)
        elif arg != "--disable-hot-restart":
            args.append(arg)
    return args


def with_files(files: Mapping[str, str], replaced: Mapping[str, Any]) -> dict[str, str]:
    """A copy of `files` with those named in `replaced` replaced by its data, as YAML."""
    out = dict(files)
    for name, value in replaced.items():
        out[name] = yaml.safe_dump(copy.deepcopy(value), sort_keys=False)
    return out


class KubeletSecret:
    """A Secret's volume as the kubelet writes it: each version in a folder of its own, the
    `..data` link to the current one swapped atomically, and each key a link through
    `..data`, made once (so a reader of `folder/key` sees an update only after the swap)."""

    _versions = itertools.count()

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def write(self, data: Mapping[str, str]) -> None:
        version = self.folder / f"..version_{next(self._versions)}"
        version.mkdir()
        for key, value in data.items():
            (version / key).write_text(value)
        old = (self.folder / "..data").resolve() if (self.folder / "..data").exists() else None
        (self.folder / "..data_tmp").symlink_to(version.name)
        (self.folder / "..data_tmp").rename(self.folder / "..data")
        for key in data:
            if not (self.folder / key).is_symlink():
                (self.folder / key).symlink_to(f"..data/{key}")
        if old is not None:
            for path in old.iterdir():
                path.unlink()
            old.rmdir()


def uncommented(text: str, *lines: str) -> str:
    """`text` with each of `lines` (commented out, as a kustomization offers an option)
    uncommented; fails when one is not there."""
    for line in lines:
        assert line in text, f"{line!r} is not in the file"
        text = text.replace(line, line.removeprefix("# "), 1)
    return text


def edited_build(
    overlay: str, edits: Mapping[str, Callable[[str], str]], workdir: Path | None = None
) -> tuple[Resource, ...]:
    """k8s/OVERLAY built from a copy of k8s/ whose files of that overlay (by name) are edited
    by `edits`, as a user would edit them; the copy is kept in `workdir` when given."""
    with tempfile.TemporaryDirectory() as scratch:
        root = (workdir or Path(scratch)) / "k8s"
        shutil.copytree(K8S, root)
        for name, edit in edits.items():
            path = root / overlay / name
            path.write_text(edit(path.read_text()))
        return tuple(kustomize(root / overlay))


WITH_API_KEY = "overlays/existing-vllm + components/vllm-api-key"


@functools.cache
def build_variant(name: str) -> tuple[Resource, ...]:
    """A shipped kustomization, or WITH_API_KEY: overlays/existing-vllm with its optional
    components/vllm-api-key uncommented, as its header says (built once per session)."""
    if name != WITH_API_KEY:
        return build(name)
    return edited_build(
        "overlays/existing-vllm",
        {
            "kustomization.yaml": lambda text: uncommented(
                text, "# components:", "# - ../../components/vllm-api-key"
            )
        },
    )
