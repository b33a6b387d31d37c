"""A seeded fault-injecting ``Store`` wrapper, for rehearsing a bad bucket.

With probability ``rate`` a call is disturbed by one fault, drawn uniformly
from those that apply to it:

* ``error``: the call fails with ``TransientStoreError`` before reaching the
  bucket;
* ``spike``: the call waits up to ``spike_s`` seconds, then runs;
* ``lost_response`` (writes and deletes): the call runs and succeeds, then
  fails with ``TransientStoreError`` as if its response was lost;
* ``partial_write`` (writes): the write dies midway: on a local bucket a temp
  file holding a prefix of the bytes is left behind (as a killed writer leaves
  one), on others nothing is created; the call fails with
  ``TransientStoreError``. A correct backend never shows such data as an object.

Enable it with the storage option ``-o faults=RATE[,seed=N][,spike_s=S]`` or
the environment variable ``DDILOCO_STORE_FAULTS`` (same syntax), e.g.
``DDILOCO_STORE_FAULTS=0.05,seed=1 ddiloco sync ./run``. ``open_store`` puts
it directly around the backend, under the retry policy, so the faults exercise
the same retries a real outage would.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Callable, TypeVar

from ddiloco_cli.errors import UsageError
from ddiloco_cli.store import TEMP_PREFIX
from ddiloco_cli.store.base import ObjectInfo, Store, StoreWrapper, TransientStoreError

log = logging.getLogger(__name__)

T = TypeVar("T")

FAULTS_ENV = "DDILOCO_STORE_FAULTS"
_READ_FAULTS = ("error", "spike")
_DELETE_FAULTS = ("error", "spike", "lost_response")
_WRITE_FAULTS = ("error", "spike", "lost_response", "partial_write")


@dataclass(frozen=True)
class FaultSpec:
    rate: float
    seed: int = 0
    spike_s: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0 or not self.spike_s >= 0:
            raise UsageError(f"bad store fault spec {self}: rate must be in [0, 1] and spike_s >= 0")

    @classmethod
    def parse(cls, text: str) -> "FaultSpec":
        """``"0.05"`` or ``"0.05,seed=1,spike_s=0.2"``; raises UsageError."""
        head, *rest = [part.strip() for part in str(text).split(",")]
        try:
            kw: dict = {"rate": float(head)}
            for part in rest:
                name, sep, value = part.partition("=")
                if not sep or name not in ("seed", "spike_s"):
                    raise ValueError(part)
                kw[name] = int(value) if name == "seed" else float(value)
        except ValueError:
            raise UsageError(f"store faults {text!r}: write RATE[,seed=N][,spike_s=S], e.g. 0.05,seed=1") from None
        return cls(**kw)


class FaultyStore(StoreWrapper):
    """``inner`` with faults injected per ``spec`` (see the module docstring).
    ``injected`` counts the faults by kind."""

    def __init__(self, inner: Store, *, spec: FaultSpec):
        super().__init__(inner)
        self.spec = spec
        self.injected: Counter[str] = Counter()
        self._rng = random.Random(spec.seed)
        self._lock = threading.Lock()

    def _draw(self, kinds: tuple[str, ...]) -> tuple[str | None, float]:
        with self._lock:
            if self._rng.random() >= self.spec.rate:
                return None, 0.0
            kind = self._rng.choice(kinds)
            self.injected[kind] += 1
            return kind, self._rng.random()

    def _run(self, kinds: tuple[str, ...], what: str, fn: Callable[[], T], *,
             partial: Callable[[float], None] | None = None) -> T:
        kind, u = self._draw(kinds)
        if kind is None:
            return fn()
        log.info("faults: %s injected into %s", kind, what)
        if kind == "spike":
            time.sleep(u * self.spec.spike_s)
            return fn()
        if kind == "lost_response":
            fn()
        elif kind == "partial_write" and partial is not None:
            partial(u)
        raise TransientStoreError(f"injected fault ({kind}) in {what}")

    def _leave_partial_temp(self, key: str, data: bytes, fraction: float) -> None:
        root = getattr(self.inner, "root", None)
        if not isinstance(root, str) or not os.path.isdir(root):
            return  # an object store's upload that dies creates nothing
        directory = os.path.join(root, *key.split("/")[:-1])
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, f"{TEMP_PREFIX}{uuid.uuid4().hex}"), "wb") as f:
            f.write(data[: int(len(data) * fraction)])

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self._run(_WRITE_FAULTS, f"create {key}", lambda: self.inner.put_if_absent(key, data),
                         partial=lambda u: self._leave_partial_temp(key, data, u))

    def put(self, key: str, data: bytes) -> None:
        self._run(_WRITE_FAULTS, f"put {key}", lambda: self.inner.put(key, data),
                  partial=lambda u: self._leave_partial_temp(key, data, u))

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        return self._run(_READ_FAULTS, f"get {key}", lambda: self.inner.get(key, max_bytes=max_bytes))

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return self._run(_READ_FAULTS, f"list {prefix!r}", lambda: self.inner.list(prefix))

    def delete(self, key: str) -> None:
        self._run(_DELETE_FAULTS, f"delete {key}", lambda: self.inner.delete(key))
