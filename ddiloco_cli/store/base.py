"""The storage seam: one small interface, several backends.

Every key is a ``str`` relative to the run root the store was opened on, with
``/`` separators (never a ``Path``: ``Path`` mangles ``s3://``).

Contract (every backend MUST honour it; ``tests/integration/test_store_conformance.py``
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
* ``get(key, max_bytes=None)`` returns the whole object or raises ``NotFound``.
  It never reads more than ``max_bytes + 1`` bytes of an object: a larger one
  raises ``ObjectTooLargeError`` (naming the key, its size and the bound).
  Anything that is not a regular object (a FIFO, device or symlink in a local
  bucket) raises ``UnreadableObjectError`` without blocking.
* ``list(prefix)`` returns ``ObjectInfo`` for every key starting with
  ``prefix``, sorted lexicographically, never served from a stale cache.
* ``delete(key)`` removes the object; a missing key is not an error.
* ``remove_stale_temp(older_than_s=..., dry_run=False)`` deletes the debris of
  writes that died midway (local ``.tmp-*`` files) older than ``older_than_s``
  and returns what it removed; backends whose writes leave none return ``[]``.
* ``now()`` is the store's clock in seconds since the epoch (``ObjectInfo.mtime_s``
  uses the same clock), so leases never trust a local clock.

Backends do not retry: they raise ``TransientStoreError`` for a failure worth
retrying (timeout, 5xx, throttling, a full or read-only disk) and
``StoreAccessError`` for one a user must fix. ``open_store`` wraps every backend
in one retry policy (``store/retry.py``).

A backend whose requests run on threads of its own (S3 and GCS: an event loop)
names them with an optional ``io_threads()`` (``io_threads(store)``), so that a
learner's cost report counts their CPU.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ddiloco_cli.errors import InvalidPayloadError, ProtocolError


class NotFound(KeyError):
    """The object does not exist."""


class TransientStoreError(Exception):
    """A store call failed in a way worth retrying (timeout, 5xx, throttling)."""


class UnreadableObjectError(InvalidPayloadError, ProtocolError, ValueError):
    """The store refused to read an object: not a regular object, or over the
    reader's size bound. Bad bucket input: readers that quarantine invalid
    payloads, skip invalid records or reject unparsable bytes (ValueError) treat
    it like any other invalid object."""


class ObjectTooLargeError(UnreadableObjectError):
    """An object is larger than the bound its reader allows."""

    def __init__(self, key: str, *, size: int | None, max_bytes: int):
        self.key, self.size, self.max_bytes = key, size, max_bytes
        got = f"{size} bytes" if size is not None else f"more than {max_bytes} bytes"
        super().__init__(f"{key}: object has {got}, above the {max_bytes}-byte bound for this key; not read")


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

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes: ...

    def list(self, prefix: str = "") -> list[ObjectInfo]: ...

    def delete(self, key: str) -> None: ...

    def remove_stale_temp(self, *, older_than_s: float, dry_run: bool = False) -> list[ObjectInfo]: ...

    def now(self) -> float: ...



def io_threads(store: Store) -> list[threading.Thread]:
    """The threads that make ``store``'s requests for its callers (an S3 or GCS store's event
    loop, ``ioloop.io_loop``), through any wrappers; none for a local or in-memory store,
    whose calls run on the calling thread."""
    get = getattr(store, "io_threads", None)
    return list(get()) if callable(get) else []


class StoreWrapper:
    """A ``Store`` that forwards every call to ``inner``; subclasses override the
    calls they change. Other attributes (``root`` of a local store, ...) are the
    inner store's."""

    def __init__(self, inner: Store):
        self.inner = inner
        self.url = inner.url

    def __getattr__(self, name: str):
        if name == "inner":  # not set yet (during unpickling or a failed __init__)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self.inner.put_if_absent(key, data)

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        return self.inner.get(key, max_bytes=max_bytes)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def remove_stale_temp(self, *, older_than_s: float, dry_run: bool = False) -> list[ObjectInfo]:
        return self.inner.remove_stale_temp(older_than_s=older_than_s, dry_run=dry_run)

    def now(self) -> float:
        return self.inner.now()
