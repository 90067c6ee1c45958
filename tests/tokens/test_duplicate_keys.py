"""Property-based: a key repeated in any object of any JSON body is refused, naming where it is;
a body without one parses exactly as json.loads parses it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.errors import Code, Refusal
from kvguard.tokens.request import load_json

KEYS = st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True)
SCALARS = st.none() | st.booleans() | st.integers() | st.text(max_size=8)
DOCUMENTS = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
    max_leaves=30,
)
OBJECTS = st.dictionaries(KEYS, DOCUMENTS, max_size=4)


def _objects(value: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every object in `value` with its path, in document order."""
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(value, dict):
        found.append((path, value))
        for key, inner in value.items():
            found += _objects(inner, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            found += _objects(inner, f"{path}[{i}]")
    return found


def _dumps(value: Any, repeat_in: int, position: int, counter: list[int]) -> str:
    """`value` as JSON, with the `repeat_in`-th object (document order) repeating a key."""
    if isinstance(value, list):
        return "[" + ", ".join(_dumps(v, repeat_in, position, counter) for v in value) + "]"
    if not isinstance(value, dict):
        return json.dumps(value)
    index = counter[0]
    counter[0] += 1
    pairs = [
        f"{json.dumps(k)}: {_dumps(v, repeat_in, position, counter)}" for k, v in value.items()
    ]
    if index == repeat_in:
        key = next(iter(value), "k")
        pairs.insert(position % (len(pairs) + 1), f"{json.dumps(key)}: 0")
        if not value:
            pairs.append(f"{json.dumps(key)}: 1")
    return "{" + ", ".join(pairs) + "}"


@settings(max_examples=300, deadline=None)
@given(document=OBJECTS, choice=st.integers(min_value=0), position=st.integers(min_value=0))
def test_a_repeated_key_is_found_where_it_is(
    document: dict[str, Any], choice: int, position: int
) -> None:
    objects = _objects(document)
    path, obj = objects[choice % len(objects)]
    key = next(iter(obj), "k")
    text = _dumps(document, choice % len(objects), position, [0])
    with pytest.raises(Refusal) as refused:
        load_json(text)
    expected = f"{path}.{key}" if path else key
    assert (refused.value.code, refused.value.param) == (Code.INVALID_REQUEST, expected)


@given(document=OBJECTS)
def test_a_body_without_repeated_keys_parses_as_json_loads(document: dict[str, Any]) -> None:
    text = json.dumps(document)
    assert load_json(text) == json.loads(text)
