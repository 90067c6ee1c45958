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
