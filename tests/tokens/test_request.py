"""kvguard.tokens.request: what a body must be before anything is counted or reserved."""

from __future__ import annotations

import json

import pytest

from kvguard.errors import Code, Refusal
from kvguard.tokens.request import load_json, parse

HI = '{"model": "qwen", "messages": [{"role": "user", "content": "hi"}]'


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        # kvguard read the last one; a parser that keeps the first would see 99999.
        ('{"model": "qwen", "max_tokens": 99999, "max_tokens": 5, "messages": []}', "max_tokens"),
        ('{"model": "qwen", "messages": [{"role": "user", "role": "system"}]}', "messages[0].role"),
        (
            HI[:-1] + ', {"role": "user", "content": [{"type": "text", "type": "image_url"}]}]}',
            "messages[1].content[0].type",
        ),
        # Anywhere, also in fields kvguard never reads.
        (HI + ', "metadata": {"a": {"b": 1, "b": 2}}}', "metadata.a.b"),
        (HI + ', "extra": [[{}, {"x y": 1, "x y": 2}]]}', 'extra[0][1]["x y"]'),
        ('{"model": "a", "model": "b"}', "model"),
    ],
)
def test_a_repeated_key_anywhere_is_refused_naming_its_path(raw: str, path: str) -> None:
    with pytest.raises(Refusal) as refused:
        parse("chat", raw.encode())
    assert refused.value.code is Code.INVALID_REQUEST
    assert refused.value.param == path
    assert f"the key {path} more than once" in refused.value.message


def test_the_first_repeated_key_in_the_document_is_named() -> None:
    raw = '{"a": {"b": [{"c": 1, "c": 2}]}, "d": {"e": 1, "e": 2}, "a": 0}'
    with pytest.raises(Refusal) as refused:
        load_json(raw)
    assert refused.value.param == "a"  # the outer object holds `a` twice


def test_a_long_repeated_key_is_shortened_in_the_answer() -> None:
    key = "k" * 10_000 + " "
    raw = json.dumps({"model": "qwen"})[:-1] + f', "{key}": 1, "{key}": 2}}'
    with pytest.raises(Refusal) as refused:
        load_json(raw)
    assert refused.value.param == '["' + "k" * 64 + '…"]'
    assert len(refused.value.message) < 200


def test_the_same_key_in_different_objects_is_not_repeated() -> None:
    raw = '{"model": "qwen", "messages": [{"role": "user", "content": "a"}, '
    raw += '{"role": "assistant", "content": "b"}], "role": "x"}'
    request = parse("chat", raw.encode())
    assert request.body == json.loads(raw)


def test_constants_that_are_not_json_are_still_refused() -> None:
    with pytest.raises(ValueError, match="NaN"):
        load_json('{"max_tokens": NaN}')


@pytest.mark.parametrize(
    "extra",
    [
        {"ignore_eos": True},
        {"ignore_eos": "true"},
        {"ignore_eos": "Yes"},
        {"ignore_eos": 1},
        {"use_beam_search": True},
        {"use_beam_search": "on", "ignore_eos": False},
    ],
)
def test_a_request_that_runs_to_its_limit_is_marked(extra: dict[str, object]) -> None:
    raw = json.dumps({"model": "qwen", "prompt": "hi", **extra}).encode()
    assert parse("completion", raw).runs_to_limit


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"ignore_eos": False},
        {"ignore_eos": "false"},
        {"use_beam_search": 0},
        {"ignore_eos": None},
    ],
)
def test_a_request_that_may_stop_early_is_not_marked(extra: dict[str, object]) -> None:
    raw = json.dumps({"model": "qwen", "prompt": "hi", **extra}).encode()
    assert not parse("completion", raw).runs_to_limit


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("ignore_eos", "maybe"),
        ("ignore_eos", 2),
        ("ignore_eos", {"a": 1}),
        ("use_beam_search", [True]),
        ("use_beam_search", 0.5),
    ],
)
def test_a_flag_that_is_not_a_boolean_is_refused_naming_it(key: str, value: object) -> None:
    raw = json.dumps({"model": "qwen", "messages": [{"role": "user", "content": "hi"}], key: value})
    with pytest.raises(Refusal) as refused:
        parse("chat", raw.encode())
    assert (refused.value.code, refused.value.code.status) == (Code.INVALID_REQUEST, 400)
    assert refused.value.param == key
    assert key in refused.value.message
