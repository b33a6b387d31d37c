"""The storage seam: one small interface, several backends.

Every key is a ``str`` relative to the run root the store was opened on, with
``/`` separators (never a ``Path``: ``Path`` mangles ``s3://``).

Contract (every backend MUST honour it; ``tests/test_store_conformance.py``
checks each one):

* ``put_if_absent(key, data)`` is the only correctness primitive: an atomic
  create-only write. It returns ``True`` when the object now holds ``data``
  because of this call (or because an earlier, lost-response attempt of this
  same call won), ``False`` when another writer's object is there. The
  ambiguity of a lost response is settled by re-reading and comparing bytes,
  so callers put a writer nonce inside any object that two writers could
  otherwise write identically.
* ``put(key, data)`` overwrites; only for non-authoritative objects
  (heartbeats, hints). Readers never see a torn object.
* ``get(key)`` returns the whole object or raises ``NotFound``.
* ``list(prefix)`` returns ``ObjectInfo`` for every key starting with
  ``prefix``, sorted lexicographically, never served from a stale cache.
* ``delete(key)`` removes the object; a missing key is not an error.
* ``now()`` is the store's clock in seconds since the epoch (``ObjectInfo.mtime_s``
  uses the same clock), so leases never trust a local clock.

Transient errors are retried inside the backends (see ``retrying``); errors a
user can fix raise ``StoreAccessError``.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Callable, Protocol, TypeVar, runtime_checkable

log = logging.getLogger(__name__)

T = TypeVar("T")


class NotFound(KeyError):
    """The object does not exist."""


class TransientStoreError(Exception):
    """A store call failed in a way worth retrying (timeout, 5xx, throttling)."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    mtime_s: float


@runtime_checkable
class Store(Protocol):
    url: str

    def put_if_absent(self, key: str, data: bytes) -> bool: ...

    def put(self, key: str, data: bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def list(self, prefix: str = "") -> list[ObjectInfo]: ...

    def delete(self, key: str) -> None: ...

    def now(self) -> float: ...


def retrying(
    fn: Callable[[], T],
    *,
    what: str,
    attempts: int = 6,
    base_delay_s: float = 0.2,
    max_delay_s: float = 5.0,
) -> T:
    """Call ``fn`` and retry ``TransientStoreError`` with jittered exponential backoff."""
    for attempt in range(attempts):
        try:
            return fn()
        except TransientStoreError as exc:
            if attempt == attempts - 1:
                raise
            delay = min(max_delay_s, base_delay_s * 2**attempt) * (0.5 + random.random())
            log.warning("store: %s failed (%s); retry %d in %.2fs", what, exc, attempt + 1, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")
