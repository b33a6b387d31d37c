"""The one retry policy of every store call (PROTOCOL.md, "Store faults").

Backends do not retry (the S3 and GCS clients' own retries are switched off or
cut to one attempt): they raise ``TransientStoreError`` and ``RetryingStore``,
which ``open_store`` puts around every backend, retries the whole call with
jittered exponential backoff (tenacity) until ``attempts`` or ``deadline_s``
runs out. Retrying a whole call is safe: ``put_if_absent`` settles a lost
response by comparing bytes, ``put`` and ``delete`` are idempotent.

Code that retries beyond one store call (the learner's uploader, which may
wait out a long outage) calls ``retrying`` with its own policy.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, TypeVar


from ddiloco_cli.errors import UsageError
from ddiloco_cli.store.base import ObjectInfo, Store, StoreWrapper, TransientStoreError

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """Retry a transient failure up to ``attempts`` times in all, sleeping a
    random time up to ``min(max_delay_s, base_delay_s * 2**n)`` before retry n,
    and start no retry once ``deadline_s`` has passed since the first attempt."""

    attempts: int = 8
    base_delay_s: float = 0.25
    max_delay_s: float = 8.0
    deadline_s: float = 60.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or not (self.base_delay_s >= 0 and self.max_delay_s >= 0 and self.deadline_s >= 0):
            raise UsageError(f"bad retry policy {self}: attempts must be >= 1 and times >= 0")

    # storage options (``-o retry_attempts=3``) that set the fields, by option name
    OPTIONS = {"retry_attempts": "attempts", "retry_base_delay_s": "base_delay_s",
               "retry_max_delay_s": "max_delay_s", "retry_deadline_s": "deadline_s"}

    @classmethod
    def pop_options(cls, options: dict) -> "RetryPolicy":
        """The policy set by the ``retry_*`` entries of ``options`` (removed from it)."""
        kw = {}
        for opt, name in cls.OPTIONS.items():
            if opt in options:
                value = options.pop(opt)
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise UsageError(f"storage option {opt}={value!r} must be a number")
                kw[name] = int(value) if name == "attempts" else float(value)
        return cls(**kw)

DEFAULT_POLICY = RetryPolicy()
# for work that must outlive an outage longer than one call's policy (each attempt is a
# whole store call, itself retried under DEFAULT_POLICY): the learner's contribution uploads
OUTAGE_POLICY = RetryPolicy(attempts=8, base_delay_s=0.5, max_delay_s=30.0, deadline_s=900.0)


def retrying(fn: Callable[[], T], *, what: str, policy: RetryPolicy = DEFAULT_POLICY,
             retry_on: tuple[type[BaseException], ...] = (TransientStoreError,)) -> T:
    """Call ``fn``; retry the exceptions in ``retry_on`` under ``policy``, logging
    each retry; the last failure is re-raised as it was."""
    started = time.monotonic()
    try:
        return fn()  # most calls succeed at once: they skip tenacity's machinery (~25 us a call)
    except retry_on as exc:
        failed: BaseException | None = exc

    def again() -> T:
        nonlocal failed
        if failed is not None:  # tenacity's first attempt is the one that just failed
            exc, failed = failed, None
            raise exc
        return fn()

    import tenacity  # only once a call has failed: commands that never retry never import it

    def log_retry(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.warning("store: %s failed (%s); retry %d in %.2fs", what, exc, state.attempt_number,
                    state.next_action.sleep if state.next_action else 0.0)

    retryer = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(retry_on),
        stop=(tenacity.stop_after_attempt(policy.attempts)
              | tenacity.stop_after_delay(max(0.0, policy.deadline_s - (time.monotonic() - started)))),
        wait=tenacity.wait_random_exponential(multiplier=policy.base_delay_s, max=policy.max_delay_s),
        before_sleep=log_retry,
        reraise=True,
    )
    return retryer(again)


class RetryingStore(StoreWrapper):
    """Every call of ``inner`` under one ``RetryPolicy``."""

    def __init__(self, inner: Store, *, policy: RetryPolicy = DEFAULT_POLICY):
        super().__init__(inner)
        self.policy = policy

    def _retry(self, fn: Callable[[], T], what: str) -> T:
        return retrying(fn, what=f"{what} on {self.url}", policy=self.policy)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self._retry(lambda: self.inner.put_if_absent(key, data), f"create {key}")

    def put(self, key: str, data: bytes) -> None:
        self._retry(lambda: self.inner.put(key, data), f"put {key}")

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        return self._retry(lambda: self.inner.get(key, max_bytes=max_bytes), f"get {key}")

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return self._retry(lambda: self.inner.list(prefix), f"list {prefix!r}")

    def delete(self, key: str) -> None:
        self._retry(lambda: self.inner.delete(key), f"delete {key}")

    def remove_stale_temp(self, *, older_than_s: float, dry_run: bool = False) -> list[ObjectInfo]:
        return self._retry(lambda: self.inner.remove_stale_temp(older_than_s=older_than_s, dry_run=dry_run),
                           "remove stale temp files")

    def now(self) -> float:
        return self._retry(self.inner.now, "read the clock")
