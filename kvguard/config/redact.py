"""URLs as kvguard shows them (output, logs, errors): with their credentials masked."""

from __future__ import annotations

import re
import urllib.parse

MASK = "***"
# Query parameters that may carry a credential: redis-py reads `?password=` and `?username=`
# like the userinfo, and `?ssl_password=` as the TLS key's password.
_CREDENTIAL = re.compile(r"pass|user|secret|token|key|auth|cred", re.IGNORECASE)


def redact(url: str) -> str:
    """`url` with any userinfo masked (`user:***@`, `:***@`; `***@` when it has no ':', as
    `redis://PASSWORD@host` is often meant) and the values of credential query parameters
    (`?password=***`). Everything before the last '@' counts as userinfo, so a password whose
    '/', '?' or '#' was not percent-encoded stays masked too."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    userinfo, at, rest = rest.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        if not colon:
            userinfo = MASK
        elif "/" in user or "?" in user or "#" in user:
            userinfo = f":{MASK}"  # past the host: what precedes the '@' is not a user name
        else:
            userinfo = f"{user}:{MASK}"
        rest = f"{userinfo}@{rest}"
    before, question, query = rest.partition("?")
    if question:
        query, hash_, fragment = query.partition("#")
        query = "&".join(_masked_parameter(item) for item in query.split("&"))
        rest = f"{before}?{query}{hash_}{fragment}"
    return f"{scheme}{sep}{rest}"


def _masked_parameter(item: str) -> str:
    name, equals, _ = item.partition("=")
    if equals and _CREDENTIAL.search(urllib.parse.unquote_plus(name)):
        return f"{name}={MASK}"
    return item
