"""How many bytes a reader accepts for each key (PROTOCOL.md, "Size bounds").

Every read of bucket bytes is bounded, so that no object anyone writes can
make a reader allocate more than a legitimate object of its kind would need:

* small JSON records (heartbeats, epochs, latest hints, learner state, clock
  probes): ``SMALL_RECORD_MAX_BYTES``;
* tensor objects of fragment p (contributions, published payloads): the
  fragment's fp32 size from the plan, plus the worst-case zstd expansion and
  ``TENSOR_HEADER_SLACK_BYTES`` for headers; outer-optimizer checkpoints hold
  up to ``CHECKPOINT_COPIES`` fp32 copies of the fragment (momentum, raw value,
  the open cycle's gradient);
* every other key (run.json, plan.json, manifests, quarantine reports):
  ``RECORD_MAX_BYTES``.

``BoundedStore`` applies ``max_bytes_for`` to every ``get``; ``open_store``
puts it around every backend, so callers need not pass bounds themselves.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from ddiloco_cli.errors import ProtocolError
from ddiloco_cli.protocol import layout
from ddiloco_cli.store.base import NotFound, Store, StoreWrapper

if TYPE_CHECKING:
    from ddiloco_cli.protocol.fragments import FragmentPlan

log = logging.getLogger(__name__)

RECORD_MAX_BYTES = 16 << 20
SMALL_RECORD_MAX_BYTES = 1 << 20
TENSOR_HEADER_SLACK_BYTES = 16 << 20
# zstd frame overhead (header, block headers, checksum) per tensor, generously
_PER_TENSOR_SLACK_BYTES = 1 << 10

_SMALL_PREFIXES = (layout.EPOCH_PREFIX, layout.SYNCER_HEARTBEAT_PREFIX, layout.LEARNER_HEARTBEAT_PREFIX,
                   layout.CLOCK_PREFIX)


CHECKPOINT_COPIES = 3


def tensor_max_bytes(plan: "FragmentPlan", fragment: int, *, copies: int = 1) -> int:
    """The most bytes a tensor object of ``fragment`` holding ``copies`` fp32 copies of
    it may have: fp32 values (the largest codec), zstd's worst-case expansion (under
    1/128 plus a frame per tensor) and header slack."""
    nbytes = plan.fragment_nbytes(fragment)
    per_copy = nbytes + nbytes // 128 + len(plan.fragments[fragment]) * _PER_TENSOR_SLACK_BYTES
    return copies * per_copy + TENSOR_HEADER_SLACK_BYTES


def max_bytes_for(key: str, plan: "FragmentPlan | None") -> int:
    """The size bound of ``key`` (see the module docstring). Without a plan, or
    for a fragment the plan does not have, a tensor key gets ``RECORD_MAX_BYTES``."""
    if key.startswith(_SMALL_PREFIXES) or layout.is_latest_hint_key(key):
        return SMALL_RECORD_MAX_BYTES
    fragment = layout.tensor_fragment(key)
    if fragment is not None and plan is not None:
        if fragment < plan.num_fragments:
            checkpoint = key.startswith(layout.checkpoint_prefix(fragment))
            return tensor_max_bytes(plan, fragment, copies=CHECKPOINT_COPIES if checkpoint else 1)
    return RECORD_MAX_BYTES


class BoundedStore(StoreWrapper):
    """Every ``get`` bounded by ``max_bytes_for(key, plan)``. The plan is read
    (bounded) from the bucket the first time a tensor key needs it and kept: a
    run's plan never changes. While the bucket holds no valid plan, tensor keys
    get the record bound and the plan is looked for again next time."""

    def __init__(self, inner: Store, *, plan: "FragmentPlan | None" = None):
        super().__init__(inner)
        self._plan = plan
        self._plan_lock = threading.Lock()

    def _get_plan(self) -> "FragmentPlan | None":
        with self._plan_lock:
            if self._plan is None:
                self._plan = self._read_plan()
            return self._plan

    def _read_plan(self) -> "FragmentPlan | None":
        from ddiloco_cli.protocol import ledger, records

        where = f"{self.url}/{layout.PLAN}"
        try:
            record = records.loads(self.get(layout.PLAN), "plan", where=where)
            return ledger.read_plan(self, run_id=record["run_id"])
        except NotFound:
            return None
        except ProtocolError as exc:  # the readers report it when they read the plan themselves
            log.debug("no size bounds from %s: %s", where, exc)
            return None

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        if max_bytes is None:
            plan = self._get_plan() if layout.tensor_fragment(key) is not None else None
            max_bytes = max_bytes_for(key, plan)
        return self.inner.get(key, max_bytes=max_bytes)
