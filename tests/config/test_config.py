"""The real loader against one bad file per error; each file opens with the messages, one
`# error:` line each."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from kvguard import config
from kvguard.admission import policy

BAD = sorted((Path(__file__).parent / "configs" / "bad").glob("*.yaml"))
GOOD_POOL = """
pools:
  - name: qwen
    models: [qwen2.5-7b-instruct]
    tokenizer: models/qwen
    max_model_len: 32768
    capacity: {blocks: 40000, block_size: 16}
"""


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_file_names_the_file_and_the_key(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines = path.read_text().splitlines()
    heading = itertools.takewhile(lambda line: line.startswith("# error: "), lines)
    expected = [line.removeprefix("# error: ") for line in heading]
    monkeypatch.chdir(path.parent)
    with pytest.raises(config.ConfigError) as info:
        config.load(path.name, environ={})
    assert info.value.problems == expected
    assert str(info.value) == "\n".join(expected)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError, match=r"nope\.yaml: cannot read"):
        config.load(tmp_path / "nope.yaml")


def test_defaults_follow_the_design(tmp_path: Path) -> None:
    path = tmp_path / "kvguard.yaml"
    path.write_text(GOOD_POOL)
    loaded = config.load(path, environ={})
    assert loaded.server.grpc_listen == "127.0.0.1:50051"
    assert loaded.server.max_body_bytes == 8388608
    assert loaded.ledger.url == "memory://" and loaded.ledger.lease_seconds == 900
    assert loaded.tenancy.default_tier is None  # fails closed: unknown tenants get 401
    assert loaded.tenancy.tier_of("anyone") is None
    assert loaded.pools[0].watermark == 0.15
    # Relative tokenizer paths are relative to the configuration file.
    assert loaded.pools[0].tokenizer == str(tmp_path / "models" / "qwen")


def test_environment_overrides_process_settings(tmp_path: Path) -> None:
    path = tmp_path / "kvguard.yaml"
    path.write_text(GOOD_POOL)
    env = {"KVGUARD_SERVER_GRPC_LISTEN": "127.0.0.1:6000", "KVGUARD_LEDGER_LEASE_SECONDS": "60"}
    loaded = config.load(path, environ=env)
    assert loaded.server.grpc_listen == "127.0.0.1:6000"
    assert loaded.ledger.lease_seconds == 60


def test_environment_override_is_validated_too(tmp_path: Path) -> None:
    path = tmp_path / "kvguard.yaml"
    path.write_text(GOOD_POOL)
    with pytest.raises(config.ConfigError, match=r"ledger.lease_seconds: Input should be"):
        config.load(path, environ={"KVGUARD_LEDGER_LEASE_SECONDS": "soon"})


def test_a_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "kvguard.yaml"
    path.write_bytes(GOOD_POOL.encode() + b"shadow: \xff\n")
    with pytest.raises(config.ConfigError) as info:
        config.load(path, environ={})
    offset = len(GOOD_POOL.encode()) + len("shadow: ")
    assert str(info.value) == f"{path}: not UTF-8 text (byte 0xff at offset {offset})"


def test_a_merge_key_may_be_overridden(tmp_path: Path) -> None:
    path = tmp_path / "kvguard.yaml"
    path.write_text(
        GOOD_POOL + "tenancy:\n  tiers:\n"
        "    free: &free {max_tokens_cap: 64, default_max_tokens: 32, max_blocks: 40}\n"
        "    pro: {<<: *free, max_blocks: 400}\n"
    )
    tiers = config.load(path, environ={}).tenancy.tiers
    assert tiers["pro"].max_blocks == 400 and tiers["pro"].max_tokens_cap == 64


def test_text_settings_take_the_environment_value_as_given(tmp_path: Path) -> None:
    path = tmp_path / "kvguard.yaml"
    path.write_text(GOOD_POOL)
    env = {
        "KVGUARD_SERVER_GRPC_LISTEN": "[::]:50051",  # a YAML flow sequence
        "KVGUARD_SERVER_OTLP_ENDPOINT": "10:50",  # YAML 1.1: the integer 650
        "KVGUARD_SERVER_ADMIN": "true",  # numbers and booleans are still read as YAML
        "KVGUARD_LEDGER_LEASE_SECONDS": "60",
    }
    loaded = config.load(path, environ=env)
    assert loaded.server.grpc_listen == "[::]:50051"
    assert loaded.server.otlp_endpoint == "10:50"
    assert loaded.server.admin is True and loaded.ledger.lease_seconds == 60


@pytest.mark.parametrize(
    ("variable", "value", "error"),
    [
        ("KVGUARD_SERVER_GRPC_LISTEN", "*:50051", "server.grpc_listen: '*:50051' is not host:port"),
        (
            "KVGUARD_SERVER_DRAIN_SECONDS",
            "@1",  # not YAML
            "server.drain_seconds: Input should be a valid number, unable to parse string as a "
            "number",
        ),
        ("KVGUARD_SERVER_WORKERS", "[" * 5000, "server.workers: Input should be a valid integer"),
        (
            "KVGUARD_LEDGER_URL",
            "redis://:p #w@redis:6379/0",  # the '#' ends the URL's host part
            "ledger.url: an '@' after the host: in a user name or password, '/', '?', '#' and "
            "'@' must be percent-encoded",
        ),
        (
            "KVGUARD_LEDGER_URL",
            "http://:envsecret@redis:6379/0",
            "ledger.url: scheme 'http': it must be memory://, redis:// or rediss://",
        ),
    ],
)
def test_a_bad_environment_value_names_the_key_and_the_variable(
    tmp_path: Path, variable: str, value: str, error: str
) -> None:
    path = tmp_path / "kvguard.yaml"
    path.write_text(GOOD_POOL)
    with pytest.raises(config.ConfigError) as info:
        config.load(path, environ={variable: value})
    assert str(info.value) == f"{path}: {error} (set by {variable})"


def test_own_tiers_without_default_tier_load_and_fail_closed(tmp_path: Path) -> None:
    path = tmp_path / "kvguard.yaml"
    path.write_text(
        GOOD_POOL + "tenancy:\n  tenants: {acme: bulk}\n  tiers:\n"
        "    bulk: {max_tokens_cap: 4096, default_max_tokens: 1024, max_blocks: 20000}\n"
        "    lite: {max_tokens_cap: 64, default_max_tokens: 32, max_blocks: 400}\n"
    )
    tenancy = config.load(path, environ={}).tenancy
    assert tenancy.default_tier is None
    assert tenancy.tier_of("acme") == "bulk" and tenancy.tier_of("stranger") is None


def test_a_tier_named_free_is_not_used_implicitly(tmp_path: Path) -> None:
    path = tmp_path / "kvguard.yaml"
    path.write_text(
        GOOD_POOL + "tenancy:\n  tiers:\n"
        "    free: {max_tokens_cap: 64, default_max_tokens: 32, max_blocks: 40}\n"
    )
    assert config.load(path, environ={}).tenancy.tier_of("stranger") is None
    path.write_text(path.read_text() + "  default_tier: free\n")
    assert config.load(path, environ={}).tenancy.tier_of("stranger") == "free"


def test_a_value_from_the_environment_gets_no_line(tmp_path: Path) -> None:
    path = tmp_path / "kvguard.yaml"
    path.write_text(GOOD_POOL + "ledger:\n  lease_seconds: 0\nshadow: maybe\n")
    with pytest.raises(config.ConfigError) as info:
        config.load(path, environ={"KVGUARD_LEDGER_LEASE_SECONDS": "-1"})
    assert info.value.problems == [
        f"{path}: ledger.lease_seconds: Input should be greater than 0 (set by "
        "KVGUARD_LEDGER_LEASE_SECONDS)",
        f"{path}: shadow: Input should be a valid boolean, unable to interpret input (line 10)",
    ]


def test_local_mode_with_a_replica_per_worker_loads(tmp_path: Path) -> None:
    path = tmp_path / "kvguard.yaml"
    path.write_text(
        GOOD_POOL + "server: {workers: 4}\n"
        "ledger: {url: 'redis://redis:6379/0', on_unavailable: local, replicas: 8}\n"
    )
    assert config.load(path, environ={}).ledger.replicas == 8


def test_replicas_are_counted_at_runtime_by_default(tmp_path: Path) -> None:
    path = tmp_path / "kvguard.yaml"
    path.write_text(
        GOOD_POOL + "ledger: {url: 'redis://redis:6379/0', on_unavailable: local, "
        "replica_service: kvguard-gateway-pods.llm.svc}\n"
    )
    ledger = config.load(path, environ={}).ledger
    assert (ledger.replicas, ledger.replica_service) == ("auto", "kvguard-gateway-pods.llm.svc")


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("replicas: 0", "ledger.replicas: 0 is neither auto (counted at runtime) nor a number"),
        ("replicas: many", "ledger.replicas: 'many' is neither auto"),
        ("replicas: true", "ledger.replicas: True is neither auto"),
        ("replica_service: 'gw:50051'", "ledger.replica_service: 'gw:50051' is not a DNS name"),
        ("replica_service: 'http://gw'", "ledger.replica_service: 'http://gw' is not a DNS name"),
    ],
)
def test_a_bad_replica_setting_is_one_clear_error(
    tmp_path: Path, setting: str, message: str
) -> None:
    path = tmp_path / "kvguard.yaml"
    path.write_text(GOOD_POOL + f"ledger: {{url: 'redis://redis:6379/0', {setting}}}\n")
    with pytest.raises(config.ConfigError) as raised:
        config.load(path, environ={})
    assert len(raised.value.problems) == 1
    assert message in raised.value.problems[0]


def _warnings(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "kvguard.yaml"
    path.write_text(text)
    return policy.warnings(config.load(path, environ={}))


def _tiers(
    free: str, pro: str = "{max_tokens_cap: 256, default_max_tokens: 64, max_blocks: 40}"
) -> str:
    return f"tenancy:\n  default_tier: free\n  tiers:\n    free: {free}\n    pro: {pro}\n"


def test_no_warnings_for_a_policy_that_can_admit(tmp_path: Path) -> None:
    tiers = _tiers("{max_tokens_cap: 512, default_max_tokens: 256, max_blocks: 2000}")
    assert _warnings(tmp_path, GOOD_POOL + tiers) == []


def test_a_tier_whose_default_never_fits_its_quota_is_a_warning(tmp_path: Path) -> None:
    # 1 prompt token + 1024 output tokens: 65 blocks of 16, above the quota of 60.
    tiers = _tiers("{max_tokens_cap: 2048, default_max_tokens: 1024, max_blocks: 60}")
    assert _warnings(tmp_path, GOOD_POOL + tiers) == [
        "tenancy.tiers.free.default_max_tokens: in pool qwen, a request without max_tokens gets "
        "1024 and needs at least 65 blocks, more than this tier's max_blocks (60): every such "
        "request is refused (400 request_exceeds_capacity)"
    ]


def test_a_tier_whose_default_never_fits_the_pool_is_a_warning(tmp_path: Path) -> None:
    # 1 + 2048 tokens need 129 blocks of 16; 140 blocks at watermark 0.15 admit 119.
    pool = GOOD_POOL.replace("blocks: 40000", "blocks: 140").replace("32768", "4096")
    tiers = _tiers("{max_tokens_cap: 2048, default_max_tokens: 2048, max_blocks: 100}")
    assert _warnings(tmp_path, pool + tiers) == [
        "tenancy.tiers.free.default_max_tokens: in pool qwen, a request without max_tokens gets "
        "2048 and needs at least 129 blocks, more than this tier's max_blocks (100): every such "
        "request is refused (400 request_exceeds_capacity)",
    ]
    tiers = _tiers("{max_tokens_cap: 2048, default_max_tokens: 2048, max_blocks: 119}")
    assert _warnings(tmp_path, pool + tiers) == [
        "tenancy.tiers.free.default_max_tokens: in pool qwen, a request without max_tokens gets "
        "2048 and needs at least 129 blocks, more than the pool's limit, capacity x (1 - "
        "watermark) (119): every such request is refused (400 request_exceeds_capacity)",
        "tenancy.tiers.free.max_blocks: 119 is not below any pool's limit (at most 119 blocks, "
        "pool qwen): this quota never binds, so one tenant of this tier may take a whole pool",
    ]


def test_the_default_is_clamped_to_the_context_before_it_is_judged(tmp_path: Path) -> None:
    # max_model_len 64: the injected limit is 63 (4 blocks), whatever the tier's default.
    pool = GOOD_POOL.replace("32768", "64")
    tiers = _tiers("{max_tokens_cap: 2048, default_max_tokens: 1024, max_blocks: 4}")
    assert _warnings(tmp_path, pool + tiers) == []


def test_a_quota_no_pool_can_reach_is_a_warning_only_where_every_capacity_is_known(
    tmp_path: Path,
) -> None:
    tiers = _tiers("{max_tokens_cap: 512, default_max_tokens: 256, max_blocks: 40000}")
    assert _warnings(tmp_path, GOOD_POOL + tiers) == [
        "tenancy.tiers.free.max_blocks: 40000 is not below any pool's limit (at most 34000 "
        "blocks, pool qwen): this quota never binds, so one tenant of this tier may take a "
        "whole pool"
    ]
    discovered = (
        "  - name: llama\n    models: [llama]\n    tokenizer: models/llama\n"
        "    max_model_len: 4096\n    capacity: {endpoints: ['http://vllm-0:8000']}\n"
    )
    assert _warnings(tmp_path, GOOD_POOL + discovered + tiers) == []


def test_a_calibrated_pool_without_discovery_is_a_warning(tmp_path: Path) -> None:
    calibrated = GOOD_POOL + "    reservation: {mode: calibrated}\n"
    tiers = _tiers("{max_tokens_cap: 512, default_max_tokens: 256, max_blocks: 2000}")
    assert _warnings(tmp_path, calibrated + tiers) == [
        "pools[0].reservation.mode: calibrated with a static capacity: no vLLM /metrics is "
        "read, so preemptions cannot move reservations back towards the worst case and leases "
        "grow at an assumed 100 tokens/s; discover the capacity from the pool's endpoints"
    ]
    silent = "server: {response_sample: 0}\n"
    assert _warnings(tmp_path, silent + calibrated + tiers) == [
        "pools[0].reservation.mode: calibrated, but with server.response_sample 0 and a static "
        "capacity nothing is learnt (no response is read, no vLLM histogram scraped): every "
        "request reserves the worst case"
    ]
    # A tier of its own that is calibrated in a worst-case pool counts too; none: no warning.
    pro = "{max_tokens_cap: 256, default_max_tokens: 64, max_blocks: 40, reservation_mode: %s}"
    assert len(_warnings(tmp_path, silent + GOOD_POOL + _tiers(
        "{max_tokens_cap: 512, default_max_tokens: 256, max_blocks: 2000}", pro % "calibrated"
    ))) == 1  # fmt: skip
    assert _warnings(tmp_path, silent + GOOD_POOL + tiers) == []
    discovered = calibrated.replace(
        "capacity: {blocks: 40000, block_size: 16}", "capacity: {endpoints: ['http://vllm:8000']}"
    )
    assert _warnings(tmp_path, silent + discovered + tiers) == []


def test_a_local_fallback_counted_only_in_redis_is_a_warning(tmp_path: Path) -> None:
    ledger = "ledger: {url: 'redis://redis:6379/0', on_unavailable: local%s}\n"

    def about_the_ledger(setting: str) -> list[str]:
        warnings = _warnings(tmp_path, GOOD_POOL + ledger % setting)
        return [w for w in warnings if w.startswith("ledger.")]

    (warning,) = about_the_ledger("")
    assert warning.startswith("ledger.replica_service: on_unavailable local counts its replicas")
    assert about_the_ledger(", replica_service: gw") == []
    assert about_the_ledger(", replicas: 2") == []


def test_no_default_tier_and_no_tenants_is_a_warning(tmp_path: Path) -> None:
    assert _warnings(tmp_path, GOOD_POOL) == [
        "tenancy: no default_tier and no tenants: every request gets 401 unknown_tenant"
    ]
    assert _warnings(tmp_path, GOOD_POOL + "tenancy: {tenants: {acme: pro}}\n") == []


def test_api_keys_that_name_no_mapped_tenant_are_a_warning(tmp_path: Path) -> None:
    digest = "0" * 64
    tenancy = f"tenancy:\n  identity: api_key\n  api_keys: {{'{digest}': acme}}\n"
    assert _warnings(tmp_path, GOOD_POOL + tenancy + "  tenants: {globex: pro}\n") == [
        "tenancy: no default_tier and no API key of api_keys names a tenant of tenants: every "
        "request gets 401 unknown_tenant"
    ]
    assert _warnings(tmp_path, GOOD_POOL + tenancy + "  tenants: {acme: pro}\n") == []


def test_api_key_identity_with_a_default_tier_is_a_warning(tmp_path: Path) -> None:
    digest = "0" * 64
    tenancy = f"tenancy:\n  identity: api_key\n  api_keys: {{'{digest}': acme}}\n"
    mapped = GOOD_POOL + tenancy + "  tenants: {acme: pro}\n"
    assert _warnings(tmp_path, mapped + "  default_tier: free\n") == [
        "tenancy.default_tier: with identity api_key, a request with no key or a key not in "
        "api_keys is admitted on tier 'free': anyone who can reach the gateway gets that tier; "
        "leave default_tier out to answer such requests 401 unknown_tenant"
    ]
    assert _warnings(tmp_path, mapped) == []
    header = GOOD_POOL + "tenancy: {default_tier: free, tenants: {acme: pro}}\n"
    assert _warnings(tmp_path, header) == []  # a trusted header: the gateway authenticates


def test_a_character_yaml_does_not_allow_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "kvguard.yaml"
    path.write_text(GOOD_POOL + "shadow: \x07\n")
    with pytest.raises(config.ConfigError) as info:
        config.load(path, environ={})
    assert str(info.value) == f"{path}: not valid YAML: character #x0007 is not allowed (line 8)"


def test_routing_pick_needs_discovered_pods(tmp_path: Path) -> None:
    path = tmp_path / "kvguard.yaml"
    path.write_text(GOOD_POOL.replace("    capacity:", "    routing: pick\n    capacity:"))
    with pytest.raises(config.ConfigError) as raised:
        config.load(path, environ={})
    assert len(raised.value.problems) == 1
    assert "pools[0].routing: pick needs the pool's pods" in raised.value.problems[0]


def test_routing_defaults_to_pick_where_discovered_and_envoy_over_several_is_a_warning(
    tmp_path: Path,
) -> None:
    tiers = _tiers("{max_tokens_cap: 512, default_max_tokens: 256, max_blocks: 2000}")
    one = GOOD_POOL.replace(
        "capacity: {blocks: 40000, block_size: 16}", "capacity: {endpoints: ['http://a:8000']}"
    )
    several = one.replace("['http://a:8000']", "['http://a:8000', 'http://b:8000']")
    service = one.replace("endpoints: ['http://a:8000']", "service: 'vllm:8000'")
    path = tmp_path / "kvguard.yaml"
    for text, picks in ((GOOD_POOL, False), (one, True), (several, True), (service, True)):
        path.write_text(text + tiers)
        assert config.load(path, environ={}).pools[0].picks is picks
    assert _warnings(tmp_path, several + tiers) == []
    routed = several.replace("    capacity:", "    routing: envoy\n    capacity:")
    assert _warnings(tmp_path, routed + tiers) == [
        "pools[0].routing: envoy over several vLLM servers counts only the pool's sum: the "
        "gateway's balancing can send more to one server than it holds, and vLLM preempts "
        "there; nothing is guaranteed per server (routing pick reserves on one and names it to "
        "the gateway)"
    ]
