"""Hot reload of the files a pool's configuration names: a chat template changed at the same path
applies with the reload (a tokenizer cache keyed by path alone kept the old one, and the
reload still logged "configuration reloaded")."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import grpc
import yaml
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvguard import config as configs
from kvguard.admission.policy import TokenizerCache, build
from kvguard.app import Service
from kvguard.testing.wait import wait_until
from kvguard.tokens.tokenizer import PoolTokenizer
from tests.conftest import kvguard_config, write_config
from tests.extproc.harness import body, exchange, headers, running, set_headers

CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}]}
SHORT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
LONG = "lorem ipsum dolor sit amet " * 50 + SHORT


async def prompt_tokens(stub: Any) -> int:
    _, (_, answer) = await exchange(stub, headers("/v1/chat/completions"), body(CHAT))
    return int(set_headers(answer.request_body.response)["x-kvguard-prompt-tokens"])


def expected_tokens(tokenizer: str, template: str, folder: Path) -> int:
    """What a fresh load of `template` counts for CHAT."""
    path = folder / "expected.jinja"
    path.write_text(template)
    fresh = PoolTokenizer.load(tokenizer, path)
    return fresh.count(fresh.render_chat(CHAT), False)


async def reloaded(service: Service, old: object) -> None:
    async def swapped() -> bool:
        return service.policy is not old

    await wait_until(swapped, "the policy to be reloaded")


async def test_a_template_rewritten_in_place_applies_with_the_reload(tmp_path: Path) -> None:
    template = tmp_path / "template.jinja"
    template.write_text(SHORT)
    async with running(tmp_path, watch=True, pool={"chat_template": "template.jinja"}) as (
        service,
        stub,
    ):
        tokenizer = service.policy.pools["qwen"].config.tokenizer
        assert await prompt_tokens(stub) == expected_tokens(tokenizer, SHORT, tmp_path)
        old = service.policy
        template.write_text(LONG)  # same path, same inode: only its stat says it changed
        data = kvguard_config()
        data["pools"][0]["chat_template"] = "template.jinja"
        data["tenancy"]["tiers"]["pro"]["max_tokens_cap"] = 1000  # what makes the file reload
        write_config(tmp_path, data)
        await reloaded(service, old)
        assert await prompt_tokens(stub) == expected_tokens(tokenizer, LONG, tmp_path)


def configmap_update(folder: Path, version: str, data: dict[str, Any], template: str) -> None:
    """The kubelet's update of a ConfigMap with kvguard.yaml and template.jinja."""
    target = folder / version
    target.mkdir()
    (target / "kvguard.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    (target / "template.jinja").write_text(template)
    link = folder / "..data_tmp"
    link.symlink_to(version)
    os.replace(link, folder / "..data")


async def test_a_template_changed_by_a_configmap_update_applies(tmp_path: Path) -> None:
    data = kvguard_config()
    data["pools"][0]["chat_template"] = "template.jinja"
    configmap_update(tmp_path, "v1", data, SHORT)
    for name in ("kvguard.yaml", "template.jinja"):
        (tmp_path / name).symlink_to(f"..data/{name}")
    path = tmp_path / "kvguard.yaml"
    service = Service(configs.load(path, environ={}), config_path=path, reload_interval_s=0.05)
    await service.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc.port}")
    stub = pb_grpc.ExternalProcessorStub(channel)
    tokenizer = data["pools"][0]["tokenizer"]
    try:
        assert await prompt_tokens(stub) == expected_tokens(tokenizer, SHORT, tmp_path)
        old = service.policy
        configmap_update(tmp_path, "v2", data, LONG)  # the same kvguard.yaml, a new template
        await reloaded(service, old)
        assert await prompt_tokens(stub) == expected_tokens(tokenizer, LONG, tmp_path)
    finally:
        await channel.close()
        await service.stop(0)


def test_the_cache_reuses_unchanged_files_and_forgets_what_no_pool_uses(tmp_path: Path) -> None:
    cache: TokenizerCache = {}
    data = kvguard_config()
    first = build(configs.load(write_config(tmp_path, data), environ={}), cache)
    again = build(configs.load(write_config(tmp_path, data), environ={}), cache)
    assert again.pools["qwen"].tokenizer is first.pools["qwen"].tokenizer  # stat only, no load
    (tmp_path / "template.jinja").write_text(SHORT)
    data["pools"][0]["chat_template"] = "template.jinja"
    templated = build(configs.load(write_config(tmp_path, data), environ={}), cache)
    assert templated.pools["qwen"].tokenizer is not first.pools["qwen"].tokenizer
    assert list(cache.values()) == [templated.pools["qwen"].tokenizer]
