"""The real loader against one bad file per error; each file's first line is the message."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvguard import config

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
    expected = path.read_text().splitlines()[0].removeprefix("# error: ")
    monkeypatch.chdir(path.parent)
    with pytest.raises(config.ConfigError) as info:
        config.load(path.name, environ={})
    assert str(info.value).startswith(expected)
    if "not valid YAML" not in expected:
        assert str(info.value) == expected


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
    assert loaded.tenancy.tier_of("anyone") == "free"
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
            "redis://:p #w@redis:6379/0",  # the '#' ends the URL's host part: port "p "
            "ledger.url: the port must be a number from 1 to 65535 (in a password, '/', '?' "
            "and '#' must be percent-encoded)",
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
