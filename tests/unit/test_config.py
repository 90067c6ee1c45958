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
