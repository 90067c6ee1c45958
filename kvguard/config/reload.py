"""Hot reload of the policy: the configuration file is polled, and a change that validates is
published for new requests; one that does not keeps the last good policy.

The file is identified by its resolved path and its stat, so a Kubernetes ConfigMap update (an
atomic swap of the `..data` symlink) counts as a change even when the mtime looks older.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from kvguard.config.loading import ConfigError

T = TypeVar("T")

log = logging.getLogger(__name__)

Signature = tuple[str, int, int, int]


def signature(path: Path) -> Signature | None:
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return None
    return (real, st.st_ino, st.st_mtime_ns, st.st_size)


class PolicyWatcher(Generic[T]):
    """For each change of `path` (seen within `interval_s`): `load(path)` in a worker thread
    (read, validate, build), then `publish(result)` on the loop. If `load` raises (ConfigError,
    OSError, ValueError, or anything else) the change is rejected and the last good policy
    stays. `on_result(applied)` once per change.
    """

    def __init__(
        self,
        path: Path,
        load: Callable[[Path], T],
        publish: Callable[[T], None],
        on_result: Callable[[bool], None],
        interval_s: float = 1.0,
    ) -> None:
        self._path = path
        self._load = load
        self._publish = publish
        self._on_result = on_result
        self._interval_s = interval_s
        self._seen = signature(path)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            current = signature(self._path)
            if current is None or current == self._seen:
                continue
            self._seen = current
            await self._reload()

    async def _reload(self) -> None:
        try:
            # Off the loop: a new pool's tokenizer takes a while to load.
            loaded = await asyncio.to_thread(self._load, self._path)
        except ConfigError as exc:
            self._reject(str(exc))
        except (OSError, ValueError) as exc:
            self._reject(f"{self._path}: {exc}")
        except Exception as exc:
            # A RecursionError from a pathological file, or a bug: rejected all the same, since
            # an exception escaping here would end the watcher and no later change would apply.
            self._reject(f"{self._path}: {type(exc).__name__}: {exc}", traceback=True)
        else:
            self._publish(loaded)
            log.info("configuration reloaded from %s", self._path)
            self._on_result(True)

    def _reject(self, message: str, *, traceback: bool = False) -> None:
        log.error(
            "configuration change rejected, keeping the last good policy: %s",
            message,
            exc_info=traceback,
        )
        self._on_result(False)
