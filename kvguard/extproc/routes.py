"""Which requests kvguard guards, which it lets pass, and which it refuses: deny by default.

A generation that reaches vLLM unguarded is a hole, and each vLLM release adds endpoints, so
only two kinds of path pass: the generation endpoints kvguard meters (GUARDED_PATHS, any
method: a guarded request is checked whatever it is) and the read-only endpoints below, by
method. Every other request is answered 404 `endpoint_not_served`: by kvguard itself, and by the
gateway's last route as well where the routes are kvguard's (envoy/envoy.yaml, the k8s gateway,
the Istio gateway's VirtualService; an Istio sidecar's routes are Istio's).

Paths match exactly, as the gateways' routes do: kvguard reads `:path` after whatever
normalisation Envoy applies before routing, so both see the same string, and no served path
holds a `%`, a `.` segment or a doubled slash that vLLM's server would decode or collapse into
another route.
"""

from __future__ import annotations

from typing import Literal

from kvguard.errors import Code, Refusal
from kvguard.tokens.request import Kind, guarded_kind

# What `classify` answers besides a guarded kind.
READ_ONLY: Literal["read_only"] = "read_only"
NOT_SERVED: Literal["not_served"] = "not_served"
Route = Kind | Literal["read_only", "not_served"]

# vLLM 0.32's endpoints that hold no KV cache and that clients or operators need through the
# gateway: model listing, probes, the version, Prometheus, and token counting (tokenize and
# Anthropic's count_tokens, which render and tokenize only). HEAD is GET without a body.
_GET = frozenset({"GET", "HEAD"})
READ_ONLY_PATHS: dict[str, frozenset[str]] = {
    "/v1/models": _GET,
    "/health": _GET,
    "/ping": _GET,
    "/version": _GET,
    "/metrics": _GET,
    "/tokenize": frozenset({"POST"}),
    "/detokenize": frozenset({"POST"}),
    "/v1/messages/count_tokens": frozenset({"POST"}),
}

# The body of the 404, word for word in every shipped Envoy configuration's last route.
NOT_SERVED_MESSAGE = (
    "this endpoint is not served through this gateway: it passes only the generation "
    "endpoints that kvguard guards and read-only ones"
)


def classify(method: str, path: str) -> Route:
    """The guarded kind of `path` (whatever its query string), READ_ONLY for a read-only
    endpoint asked with one of its methods, NOT_SERVED for anything else."""
    kind = guarded_kind(path)
    if kind is not None:
        return kind
    if method in READ_ONLY_PATHS.get(path.split("?", 1)[0], ()):
        return READ_ONLY
    return NOT_SERVED


def not_served() -> Refusal:
    return Refusal(Code.ENDPOINT_NOT_SERVED, NOT_SERVED_MESSAGE)
