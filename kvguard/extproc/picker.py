"""The endpoint picker's words (Gateway API Inference Extension, v1.0.0,
docs/proposals/004-endpoint-picker-protocol): where kvguard sends a request, which pods the
gateway allows, and where the gateway says it went.

The pick goes as a request header and, with the same value, as dynamic metadata `envoy.lb`
(what Envoy's override_host policy and ORIGINAL_DST clusters read); the gateway's subset hint
comes in the `envoy.lb.subset_hint` metadata it forwards, the pod that served the request in
`envoy.lb` on the response path. Only the gateway and the picker set these: a client's copy of
any of these headers is removed.
"""

from __future__ import annotations

from envoy.config.core.v3.base_pb2 import Metadata
from google.protobuf.struct_pb2 import Struct, Value

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
PICKER_HEADERS = frozenset({DESTINATION, SERVED, SUBSET})
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"


def _addresses(value: Value) -> list[str]:
    """A list of strings, or a string of comma-separated ones, as the protocol allows."""
    if value.HasField("list_value"):
        return [v.string_value.strip() for v in value.list_value.values if v.string_value]
    return [part.strip() for part in value.string_value.split(",")]


def subset_hint(metadata: Metadata) -> frozenset[str] | None:
    """The pods the gateway allows (host:port), from its `envoy.lb.subset_hint` metadata; None
    when it sends none. A hint that names nothing allows nothing."""
    hint = metadata.filter_metadata.get(SUBSET_NAMESPACE)
    if hint is None or SUBSET not in hint.fields:
        return None
    return frozenset(a for a in _addresses(hint.fields[SUBSET]) if a)


def served(metadata: Metadata) -> str:
    """The pod that served the request, from the gateway's `envoy.lb` metadata; "" when it
    says nothing (the first, where it names several: they are tried in order)."""
    lb: Struct | None = metadata.filter_metadata.get(LB_NAMESPACE)
    if lb is None or SERVED not in lb.fields:
        return ""
    named = [a for a in _addresses(lb.fields[SERVED]) if a]
    return named[0] if named else ""
