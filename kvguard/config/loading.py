"""Loading the configuration: one YAML file, read strictly, the process settings overridden from
the environment, then validated against kvguard.config.schema.

Every error names the file, the dotted key and, where the file has it, its line, e.g.
``kvguard.yaml: pools[0].capacity.blocks: Input should be greater than 0 (line 12)``; a file
with several errors gets them all, one a line.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import re
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from kvguard.config.schema import (
    SHA256_HEX,
    Config,
    Key,
    LedgerSettings,
    PoolConfig,
    Problems,
    ServerSettings,
)


class ConfigError(Exception):
    """A configuration that cannot be used: `problems` holds one line per error, each naming
    the file and the key; the message is those lines."""

    def __init__(self, *problems: str) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _key_path(loc: tuple[Any, ...]) -> Key:
    """A pydantic error location without the names of validators and union members."""
    return tuple(
        part
        for part in loc
        if isinstance(part, int)
        or not (str(part).startswith("function-") or str(part) in {"int", "float"})
    )


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_API_KEYS: Key = ("tenancy", "api_keys")


def _dotted(path: Key) -> str:
    """`pools[0].capacity`, `tenancy.tenants["acme corp"]`; an `api_keys` entry that is not a
    digest may be a pasted key, so it shows at most its first 4 characters: `api_keys[sk-l…]`."""
    out = ""
    for i, part in enumerate(path):
        if isinstance(part, int):
            out += f"[{part}]"
        elif path[:i] == _API_KEYS and not SHA256_HEX.fullmatch(part):
            out += f"[{part[:4] if len(part) >= 16 else ''}…]"
        elif _NAME.fullmatch(part):
            out += ("." if out else "") + part
        else:
            out += f"[{json.dumps(part, ensure_ascii=False)}]"
    return out


def _key_lines(root: yaml.Node) -> dict[Key, int]:
    """The line (from 1) of each key and list item of a composed YAML document. A mapping's
    merged keys (`<<: *base`) are where the anchor gave them, its own keys override them."""
    lines: dict[Key, int] = {}
    stack: list[tuple[Key, yaml.Node, frozenset[int]]] = [((), root, frozenset())]
    while stack:
        path, node, above = stack.pop()
        if id(node) in above:
            continue  # a recursive alias
        above |= {id(node)}
        children: dict[str | int, tuple[yaml.Node, yaml.Node]] = {}
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:  # flattened by construction: merged pairs first
                if isinstance(key, yaml.ScalarNode) and key.tag != _MERGE_TAG:
                    children[key.value] = (key, value)
        elif isinstance(node, yaml.SequenceNode):
            children = {i: (item, item) for i, item in enumerate(node.value)}
        for part, (mark, value) in children.items():
            lines[(*path, part)] = mark.start_mark.line + 1
            stack.append(((*path, part), value, above))
    return lines


def _line_of(path: Key, lines: dict[Key, int]) -> int | None:
    """The line of the key at `path`, else of its nearest enclosing key that the file has (a
    missing key belongs there); None at the top level."""
    for end in range(len(path), 0, -1):
        if path[:end] in lines:
            return lines[path[:end]]
    return None


def _accepted_keys(path: Key) -> list[str]:
    """The keys the model at `path` accepts; [] where no model is."""
    annotation: Any = Config
    for part in path:
        if get_origin(annotation) in (types.UnionType, Union):
            members = [a for a in get_args(annotation) if a is not type(None)]
            annotation = members[0] if len(members) == 1 else None
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(part) if isinstance(part, str) else None
            annotation = field.annotation if field else None
        elif get_origin(annotation) is list and isinstance(part, int):
            annotation = get_args(annotation)[0]
        elif get_origin(annotation) is dict and isinstance(part, str):
            annotation = get_args(annotation)[1]
        else:
            return []
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return list(annotation.model_fields)
    return []


def _problems(
    error: Any, source: str, lines: dict[Key, int], overridden: dict[str, str]
) -> list[str]:
    """One line per problem of a pydantic error: `source: key: message (line N)`."""
    base = _key_path(tuple(error["loc"]))
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, Problems):  # a model check's, at paths below the model
        found = [((*base, *path), message) for path, message in cause.problems]
    else:
        message = str(error["msg"]).removeprefix("Value error, ")
        if base and base[-1] == "[key]":  # a mapping key YAML read as a number, date, ...
            base, message = (*base[:-2], str(base[-2])), "a key must be text (quote it)"
        if error["type"] == "extra_forbidden" and base and isinstance(base[-1], str):
            close = difflib.get_close_matches(base[-1], _accepted_keys(base[:-1]), n=1)
            if close:
                message += f"; did you mean {close[0]!r}?"
        found = [(base, message)]
    out = []
    for path, text in found:
        location = _dotted(path) or "(top level)"
        if location in overridden:
            text += f" (set by {overridden[location]})"
        elif (line := _line_of(path, lines)) is not None:
            text += f" (line {line})"
        out.append(f"{source}: {location}: {text}")
    return out


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, node: yaml.Node) -> None:
        super().__init__("duplicate key")  # the key may be a pasted API key: parse words it
        self.key, self.node = key, node


class _UniqueKeyLoader(yaml.SafeLoader):
    """The safe loader, refusing a key given twice in one mapping (YAML would keep the last),
    and a date that does not exist with its line (the safe loader raises a bare ValueError)."""

    def construct_yaml_timestamp(self, node: yaml.ScalarNode) -> Any:
        try:
            return super().construct_yaml_timestamp(node)
        except ValueError as exc:
            raise yaml.constructor.ConstructorError(
                None, None, f"not a date: {exc}", node.start_mark
            ) from None

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` entries may be overridden, that is their purpose
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:
                continue  # unhashable: the safe loader itself refuses it
            if duplicate:
                raise _DuplicateKey(key, key_node)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(
    "tag:yaml.org,2002:timestamp", _UniqueKeyLoader.construct_yaml_timestamp
)


def _is_text(annotation: Any) -> bool:
    """A str field, or a Literal of strings."""
    if get_origin(annotation) is Literal:
        return all(isinstance(arg, str) for arg in get_args(annotation))
    return annotation is str


def _env_overrides(raw: dict[str, Any], environ: dict[str, str]) -> dict[str, str]:
    """Apply KVGUARD_<SECTION>_<KEY> to the process settings; {"section.key": variable} of those
    applied. A text setting takes the value as given (YAML would read `10:50` as 650 and cut
    ` #x`); others read it as a YAML scalar (`60`, `true`), or as given if it is not YAML."""
    applied: dict[str, str] = {}
    for section, model in (("server", ServerSettings), ("ledger", LedgerSettings)):
        for key, field in model.model_fields.items():
            name = f"KVGUARD_{section}_{key}".upper()
            value = environ.get(name)
            if value is None:
                continue
            target = raw.setdefault(section, {})
            if not isinstance(target, dict):
                return applied  # validation reports the wrong type
            target[key] = value
            if value and not _is_text(field.annotation):
                # Not YAML: validation refuses the text, naming the key and the variable.
                with contextlib.suppress(yaml.YAMLError, RecursionError):
                    target[key] = yaml.safe_load(value)
            applied[f"{section}.{key}"] = name
    return applied


def _read_yaml(text: str, source: str) -> tuple[Any, dict[Key, int]]:
    """The document and the line of each of its keys; ConfigError if it is not valid YAML.
    The messages quote no text of the file: the line at fault may hold a password."""
    try:
        loader = _UniqueKeyLoader(text)  # a SafeLoader; it checks the characters first
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        raise ConfigError(
            f"{source}: not valid YAML: character #x{exc.character:04x} is not allowed "
            f"(line {line})"
        ) from None
    root = None
    try:
        root = loader.get_single_node()
        if root is None:
            return None, {}
        return loader.construct_document(root), _key_lines(root)
    except _DuplicateKey as exc:
        line = exc.node.start_mark.line + 1
        path = _path_to(root, exc.node) if root is not None else None
        key = _dotted(path) if path and path[:-1] == _API_KEYS else repr(exc.key)
        raise ConfigError(f"{source}: line {line}: duplicate key {key}") from None
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {_yaml_problem(exc)}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML ({type(exc).__name__})") from None
    except RecursionError:
        raise ConfigError(f"{source}: not valid YAML: nested too deeply") from None
    finally:
        loader.dispose()


def _yaml_problem(exc: yaml.MarkedYAMLError) -> str:
    """What a YAML error says, on one line: "while scanning a quoted scalar (line 2, column
    8): found unexpected end of stream (line 3, column 1)"."""

    def at(mark: Any) -> str:
        return f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""

    parts = []
    if exc.context:
        same = exc.context_mark is exc.problem_mark
        parts.append(exc.context + ("" if same else at(exc.context_mark)))
    parts.append((exc.problem or "cannot be read") + at(exc.problem_mark))
    return ": ".join(parts)


def _path_to(root: yaml.Node, target: yaml.Node) -> Key | None:
    """The path of the key or item `target` in the composed document `root`."""
    stack: list[tuple[Key, yaml.Node]] = [((), root)]
    seen: set[int] = set()
    while stack:
        path, node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                part = key.value if isinstance(key, yaml.ScalarNode) else ""
                if key is target:
                    return (*path, part)
                stack.append(((*path, part), value))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(((*path, i), item) for i, item in enumerate(node.value))
    return None


def parse(text: str, source: str, environ: dict[str, str] | None = None) -> Config:
    """Parse and validate configuration text; `source` names it in errors. Raises ConfigError
    with every problem pydantic finds."""
    raw, lines = _read_yaml(text, source)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    overridden = _env_overrides(raw, dict(os.environ) if environ is None else environ)
    try:
        config = Config.model_validate(raw)
    except ValidationError as exc:
        problems = [p for e in exc.errors() for p in _problems(e, source, lines, overridden)]
        raise ConfigError(*problems) from None
    # The folder as named, not resolved: a ConfigMap's file is a symlink into a versioned folder.
    base = Path(os.path.abspath(source)).parent
    return config.model_copy(update={"pools": [_resolve_paths(p, base) for p in config.pools]})


def _resolve_paths(pool: PoolConfig, base: Path) -> PoolConfig:
    """Tokenizer and template paths are relative to the configuration file."""
    update: dict[str, str] = {"tokenizer": str(base / pool.tokenizer)}
    if pool.chat_template:
        update["chat_template"] = str(base / pool.chat_template)
    return pool.model_copy(update=update)


def load(path: str | Path, environ: dict[str, str] | None = None) -> Config:
    """Read and validate the configuration file at `path`."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        byte = exc.object[exc.start]
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {byte:#04x} at offset {exc.start})"
        ) from None
    return parse(text, str(path), environ)
