"""URLs as kvguard shows them: every credential masked, the rest as written."""

from __future__ import annotations

import pytest

from kvguard.config.redact import redact


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("memory://", "memory://"),
        ("redis://redis:6379/0", "redis://redis:6379/0"),
        ("redis://:pw@redis:6379/0", "redis://:***@redis:6379/0"),
        ("rediss://kvguard:pw@redis:6380/1", "rediss://kvguard:***@redis:6380/1"),
        # A userinfo without ':' is masked whole: redis://PASSWORD@host is a common slip.
        ("redis://USECRET@redis:6379/0", "redis://***@redis:6379/0"),
        ("redis://:pw@[::1]:6379/0", "redis://:***@[::1]:6379/0"),
        ("redis://:p@ss@redis:6379/0", "redis://:***@redis:6379/0"),
        # redis-py reads ?password= and ?username= as the userinfo.
        (
            "redis://127.0.0.1:6379/0?password=QSECRET&protocol=3",
            "redis://127.0.0.1:6379/0?password=***&protocol=3",
        ),
        (
            "redis://redis/0?username=bob&ssl_password=x&socket_timeout=2#f",
            "redis://redis/0?username=***&ssl_password=***&socket_timeout=2#f",
        ),
        ("http://u:pw@vllm-0:8000/metrics", "http://u:***@vllm-0:8000/metrics"),
        # A password whose '#', '/' or '?' was not percent-encoded spills past the host.
        ("redis://:12#34@redis:6379/0", "redis://:***@redis:6379/0"),
        ("redis://user:p/w@redis:6379/0", "redis://user:***@redis:6379/0"),
        ("redis://us/er:pw@redis:6379/0", "redis://:***@redis:6379/0"),
    ],
)
def test_credentials_are_masked(url: str, shown: str) -> None:
    assert redact(url) == shown
