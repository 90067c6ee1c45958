"""docs/design.md's status-code tables match the code: kvguard's own answers (kvguard.errors:
every code with its HTTP status and OpenAI error type) and Envoy's, as envoy/envoy.yaml's
local replies write them."""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from kvguard.errors import Code
from tests.docs.markdown import DOCS, ROOT, code_spans, read, section, tables_headed

PAGE = DOCS / "design.md"
ENVOY = ROOT / "envoy" / "envoy.yaml"


def rows(text: str) -> list[tuple[str, str, str]]:
    """(status, code, type) of each row of the `| status | code | type | ...` tables in `text`;
    the status as its number (`429 + retry-after` -> `429`) or its class (`5xx`)."""
    found = []
    for table in tables_headed(text, "status", "code", "type"):
        for row in table:
            status = re.match(r"\d(?:\d\d|xx)", row[0])
            ((code,), (kind,)) = code_spans(row[1]), code_spans(row[2])
            found.append((status.group() if status else row[0], code, kind))
    return found


def kvguard_answers(text: str) -> list[tuple[str, str, str]]:
    own = section(text, "Status codes")
    return rows(own.split("### Envoy's own answers", 1)[0])


def test_kvguards_table_is_the_code_table() -> None:
    documented = kvguard_answers(read(PAGE))
    assert sorted(documented) == sorted((str(c.status), c.value, c.error_type) for c in Code)


def envoy_replies() -> set[tuple[str, str]]:
    """(code, type) of each error body envoy/envoy.yaml writes: its local_reply_config's and its
    routes' direct responses."""
    config: Any = yaml.safe_load(ENVOY.read_text())
    (listener,) = config["static_resources"]["listeners"]
    (chain,) = listener["filter_chains"]
    (manager,) = chain["filters"]
    mappers = manager["typed_config"]["local_reply_config"]["mappers"]
    errors = [m["body_format_override"]["json_format"]["error"] for m in mappers]
    for host in manager["typed_config"]["route_config"]["virtual_hosts"]:
        for route in host["routes"]:
            if "direct_response" in route:
                errors.append(
                    json.loads(route["direct_response"]["body"]["inline_string"])["error"]
                )
    return {(e["code"], e["type"]) for e in errors}


def test_envoys_table_is_what_envoy_yaml_answers() -> None:
    envoys = section(read(PAGE), "Envoy's own answers")
    assert {(code, kind) for _, code, kind in rows(envoys)} == envoy_replies()


def test_a_wrong_status_or_type_is_caught() -> None:
    page = read(PAGE).replace(
        "| 404 | `model_not_found` | `invalid_request_error` |",
        "| 400 | `model_not_found` | `server_error` |",
    )
    assert page != read(PAGE)
    documented = kvguard_answers(page)
    assert sorted(documented) != sorted((str(c.status), c.value, c.error_type) for c in Code)
