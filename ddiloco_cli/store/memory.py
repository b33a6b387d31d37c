"""An in-process bucket for unit tests: ``memory://name``.

Buckets live in a process-global dict keyed by name, so two ``open_store``
calls with the same name share data (within one process only). Thread-safe. ``clock`` (default: ``time.time``) stamps object times and answers ``now()``:
the deterministic simulation passes its virtual clock.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from ddiloco_cli.store import check_key
from ddiloco_cli.store.base import NotFound, ObjectInfo, ObjectTooLargeError

_LOCK = threading.Lock()
# name -> key -> (bytes, mtime_s)
_BUCKETS: dict[str, dict[str, tuple[bytes, float]]] = {}


class MemoryStore:
    def __init__(self, name: str, *, clock: Callable[[], float] = time.time):
        self.name = name
        self.clock = clock
        self.url = f"memory://{name}"
        with _LOCK:
            self._objects = _BUCKETS.setdefault(name, {})

    def put_if_absent(self, key: str, data: bytes) -> bool:
        check_key(key)
        data = bytes(data)
        with _LOCK:
            existing = self._objects.get(key)
            if existing is not None:
                return existing[0] == data
            self._objects[key] = (data, self.clock())
            return True

    def put(self, key: str, data: bytes) -> None:
        check_key(key)
        with _LOCK:
            self._objects[key] = (bytes(data), self.clock())

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        check_key(key)
        with _LOCK:
            try:
                data = self._objects[key][0]
            except KeyError:
                raise NotFound(key) from None
        if max_bytes is not None and len(data) > max_bytes:
            raise ObjectTooLargeError(key, size=len(data), max_bytes=max_bytes)
        return data

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        with _LOCK:
            out = [
                ObjectInfo(key=k, size=len(v[0]), mtime_s=v[1])
                for k, v in self._objects.items()
                if k.startswith(prefix)
            ]
        out.sort(key=lambda o: o.key)
        return out

    def delete(self, key: str) -> None:
        check_key(key)
        with _LOCK:
            self._objects.pop(key, None)

    def remove_stale_temp(self, *, older_than_s: float, dry_run: bool = False) -> list[ObjectInfo]:
        return []  # writes are atomic in memory: nothing is ever left half-written

    def now(self) -> float:
        return self.clock()


def drop_bucket(name: str) -> None:
    """Forget the in-memory bucket ``name`` (test isolation)."""
    with _LOCK:
        _BUCKETS.pop(name, None)
