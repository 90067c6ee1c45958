"""docs/configuration.md names exactly the keys of the configuration schema, with their
defaults.

The page's reference tables (a header `| key | default | meaning |`) name one key per row by its
path in the file, in a code span: `server.grpc_listen`, `pools[].name` (each item of a list),
`tenancy.tiers.*.max_blocks` (each entry of a mapping of models). Every field of every model
below `kvguard.config.schema.Config` is a key, sections included.
"""

from __future__ import annotations

import re
import types
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from kvguard.config.schema import Config
from tests.docs.markdown import DOCS, code_spans, read, tables_headed

PAGE = DOCS / "configuration.md"


def _model_in(annotation: Any) -> tuple[type[BaseModel] | None, str]:
    """The model a field holds, and how its keys continue the path: "" (the model itself),
    "[]" (each item of a list) or ".*" (each value of a mapping)."""
    if get_origin(annotation) in (types.UnionType, Union):
        members = [a for a in get_args(annotation) if a is not type(None)]
        return _model_in(members[0]) if len(members) == 1 else (None, "")
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    if get_origin(annotation) is list:
        model, _ = _model_in(get_args(annotation)[0])
        return model, "[]"
    if get_origin(annotation) is dict:
        model, _ = _model_in(get_args(annotation)[1])
        return model, ".*"
    return None, ""


def schema_keys(model: type[BaseModel] = Config, prefix: str = "") -> dict[str, FieldInfo]:
    """Every key of `model`, recursively, by its documented path."""
    keys: dict[str, FieldInfo] = {}
    for name, field in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        keys[path] = field
        inner, step = _model_in(field.annotation)
        if inner is not None:
            keys.update(schema_keys(inner, path + step))
    return keys


def documented_keys(text: str) -> dict[str, str]:
    """key -> its default cell, from the reference tables of a configuration page's `text`."""
    rows = [row for table in tables_headed(text, "key", "default") for row in table]
    documented: dict[str, str] = {}
    for row in rows:
        spans = code_spans(row[0])
        assert len(spans) == 1 and row[0] == f"`{spans[0]}`", f"one key per row: {row[0]}"
        assert spans[0] not in documented, f"{spans[0]} is documented twice"
        documented[spans[0]] = row[1]
    return documented


def wrong_defaults(documented: dict[str, str], keys: dict[str, FieldInfo]) -> list[str]:
    """Rows whose default cell disagrees with the schema: "required" for a required key, and a
    single code span holding the default as YAML, where there is one."""
    wrong = []
    for key, cell in documented.items():
        field = keys.get(key)
        if field is None:
            continue
        if (cell == "required") != field.is_required():
            wrong.append(f"{key}: {cell!r}, required={field.is_required()}")
        elif re.fullmatch(r"`[^`]+`", cell):
            default = field.get_default(call_default_factory=True)
            shown = yaml.safe_load(cell.strip("`"))
            if isinstance(default, BaseModel) or shown != default:
                wrong.append(f"{key}: documented {shown!r}, the schema's default is {default!r}")
    return wrong


def test_the_reference_names_exactly_the_schema_keys() -> None:
    documented, keys = set(documented_keys(read(PAGE))), set(schema_keys())
    assert sorted(keys - documented) == [], "keys the reference lacks"
    assert sorted(documented - keys) == [], "keys the schema lacks"


def test_the_reference_gives_the_schema_defaults() -> None:
    assert wrong_defaults(documented_keys(read(PAGE)), schema_keys()) == []


def test_the_keys_are_walked_through_sections_lists_and_mappings() -> None:
    keys = schema_keys()
    for key in ("server.workers", "pools[].capacity.refresh_seconds", "tenancy.tiers.*.max_blocks"):
        assert key in keys
    assert "tenancy.api_keys.*" not in keys  # a mapping of text is one key


def test_a_missing_extra_or_wrong_row_is_found() -> None:
    page = (
        "| key | default | meaning |\n|---|---|---|\n"
        "| `server.grpc_listen` | `127.0.0.1:1` | wrong default |\n"
        "| `server.nonsense` | `1` | not in the schema |\n"
        "| `pools[].name` | `x` | required in the schema |\n"
    )
    documented, keys = documented_keys(page), schema_keys()
    assert "server.nonsense" in set(documented) - set(keys)
    assert "server.workers" in set(keys) - set(documented)
    assert len(wrong_defaults(documented, keys)) == 2
