"""The syncer's intake: listing contributions, validating them, quarantine, and the
ledger entry every contribution ends in.

Every contribution a syncer lists ends in exactly one ledger entry of a committed
manifest (PROTOCOL.md "Version manifests", [W9]):

* ``used``: merged into that version, with its staleness (cycles) and discount;
* ``superseded``: a newer contribution of the same learner *on the same base*
  carries its progress (``carried_by`` names that one's seq);
* ``refused``: valid but not merged, with a ``reason`` the learner reads (too stale).

An *invalid* contribution gets no ledger entry: its quarantine report is the record
(its key, seq and header cannot be trusted, so it must not move a high-water mark).

The pending-set rule (``add_pending``) is a pure function: a newer contribution
supersedes an older one only when both have the same base; across a re-base both
are merged, each against its own base.
"""

from __future__ import annotations

import logging
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch

from ddiloco_cli.clock import WALL, Clock
from ddiloco_cli.errors import InvalidPayloadError, ProtocolError
from ddiloco_cli.numerics import codec
from ddiloco_cli.numerics.merge import norm, token_weight
from ddiloco_cli.numerics.quantized import DecodedTensors, sources
from ddiloco_cli.protocol import layout, records, signing
from ddiloco_cli.protocol.fragments import FragmentPlan
from ddiloco_cli.protocol.published import expected_shapes
from ddiloco_cli.protocol.runconfig import RunConfig
from ddiloco_cli.protocol.typed_records import REFUSED, SUPERSEDED, USED, LedgerEntry
from ddiloco_cli.store.base import NotFound, ObjectInfo, Store, UnreadableObjectError
from ddiloco_cli.syncer.judge import Judge, Verdict
from ddiloco_cli.syncer.replay import fetch_contribution

__all__ = ["REFUSED", "SUPERSEDED", "USED", "Contribution", "Intake", "add_pending"]

log = logging.getLogger(__name__)

Tensors = Mapping[str, torch.Tensor]  # a DecodedTensors for contributions: int4/int8 ones stay as their codes

QUARANTINE_REPORT_MAX_BYTES = 64 << 10  # a report is a few hundred bytes; its reason is cut at 4 KiB
DECODE_THREADS = min(4, os.cpu_count() or 1)  # contributions decoded at once by one syncer


@dataclass
class Contribution:
    learner_id: str
    seq: int
    key: str
    sha256: str
    size: int
    base_version: int
    c_tokens: int
    c_steps: int
    delta: Tensors
    norm: float = 0.0  # delta_norm(delta), computed once at intake (the syncer's norm bound)
    staleness: float = 0.0  # cycles between its base and the version it is merged into
    discount: float = 1.0
    # The same learner's contribution on the same base that an earlier version already merged
    # ({seq, key, sha256, c_tokens, c_steps}); this one's delta and counters include it, so only
    # the increment's tokens and steps count. None otherwise.
    increment_of: dict[str, Any] | None = None
    clip: float = 1.0  # its delta scaled by this to the norm bound (``Judge.admission``)
    share_cap: float = 1.0  # its weight cut by this: one learner's share of a merge is capped (``decide``)
    max_steps: int | None = None  # the steps and tokens its weight may count (``Decider.bound_counters``)
    max_tokens: int | None = None

    @property
    def merged_tokens(self) -> int:
        return self.c_tokens - (self.increment_of["c_tokens"] if self.increment_of else 0)

    @property
    def merged_steps(self) -> int:
        return self.c_steps - (self.increment_of["c_steps"] if self.increment_of else 0)

    @property
    def weight(self) -> float:
        steps = max(0, self.merged_steps)
        if self.max_steps is not None:
            steps = min(steps, self.max_steps)
        tokens = max(0, self.merged_tokens)
        if self.max_tokens is not None:
            tokens = min(tokens, self.max_tokens * steps)  # max_tokens: per step counted
        return token_weight(tokens, steps)

    def entry(self, status: str, *, reason: str = "", carried_by: int | None = None) -> LedgerEntry:
        """Its ledger entry. A used one carries everything a replay needs."""
        used = status == USED
        return LedgerEntry(
            self.learner_id, self.seq, self.key, self.size, used, sha256=self.sha256, base_version=self.base_version,
            c_tokens=self.c_tokens, c_steps=self.c_steps, weight=self.weight, status=status,
            staleness=self.staleness if used else None, discount=self.discount if used else None,
            merged_tokens=self.merged_tokens if used else None, increment_of=self.increment_of if used else None,
            reason=reason or None, carried_by=carried_by,
            clip=self.clip if used and self.clip < 1.0 else None,
            share_cap=self.share_cap if used and self.share_cap < 1.0 else None,
            norm=self.norm * self.clip if used else None)


def delta_norm(delta: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm of a whole delta (every tensor): ``merge.norm`` per tensor, so an int4/int8
    contribution's comes from its codes, without dequantising it."""
    return math.sqrt(sum(norm(t) ** 2 for t in sources(delta).values()))


def add_pending(pending: list[Contribution], new: Contribution) -> list[LedgerEntry]:
    """Insert ``new`` into one learner's pending list (kept in seq order) and return the
    ledger entries of the contributions it supersedes: of two neighbours on the same base
    the newer carries the older's progress (the learner's counters and delta both run from
    that base); on different bases both stay, each merged against its own base."""
    pending.append(new)
    pending.sort(key=lambda c: c.seq)
    out = []
    i = 0
    while i < len(pending) - 1:
        older, newer = pending[i], pending[i + 1]
        if older.base_version == newer.base_version:
            out.append(older.entry(SUPERSEDED, reason="superseded", carried_by=newer.seq))
            del pending[i]
        else:
            i += 1
    return out


@dataclass
class _Fetched:
    """One contribution as downloaded and decoded off the main thread (``Intake._fetch``)."""

    data: bytes | None = None  # None: gone, or unreadable (then ``error``)
    tensors: DecodedTensors | None = None
    header: dict[str, Any] | None = None
    norm: float = 0.0
    error: InvalidPayloadError | None = None  # it does not decode, or cannot be read
    signature: Verdict | None = None  # [A2], judged on the raw bytes before decoding


class Intake:
    """Lists, downloads and validates contributions; quarantines what fails [V1][V2].
    ``decode_threads`` > 1 decodes several contributions at once (``load_all``); 1 decodes
    inline, on the caller's thread (the deterministic simulation)."""

    def __init__(self, store: Store, *, config: RunConfig, plan: FragmentPlan, syncer_id: str,
                 epoch: Callable[[], int], judge: Judge,
                 decode_threads: int = DECODE_THREADS, clock: Clock = WALL,
                 signer: signing.Signer | None = None):
        self.store = store
        self.clock = clock
        self.config = config
        self.run_id = config.run_id
        self.plan = plan
        self.syncer_id = syncer_id
        self.epoch = epoch
        self.judge = judge
        self.signer = signer  # signs quarantine reports, so a restarted syncer can believe them
        self.bad_keys: set[str] = set()
        self._reports: dict[str, ObjectInfo] | None = None  # reports found at start, not yet believed
        self.reports_believed = 0
        self.num_quarantined = 0
        self.bytes_in = 0
        self.decode_threads = decode_threads
        self._pool: ThreadPoolExecutor | None = None

    def list_new(self, fragments: list[int]) -> dict[int, list[ObjectInfo]]:
        """One LIST for all owned fragments (one per fragment would cost P LISTs a poll)."""
        if len(fragments) == 1:
            infos = self.store.list(layout.contribution_prefix(fragments[0]))
        else:
            infos = self.store.list(layout.CONTRIBUTION_ROOT)
        if self._reports is None:  # once per syncer: the reports earlier syncers left
            self._reports = {}
            for rinfo in self.store.list(layout.QUARANTINE_PREFIX):
                original = layout.parse_quarantine_key(rinfo.key)
                if original is not None:
                    self._reports[original] = rinfo
        by_fragment: dict[int, list[ObjectInfo]] = {p: [] for p in fragments}
        for info in infos:
            p = layout.parse_fragment_dir(info.key)
            if p in by_fragment and info.key not in self.bad_keys:
                by_fragment[p].append(info)
        return by_fragment

    def quarantine(self, key: str, reason: str, *, size: int | None = None) -> None:
        """Record a report: a bounded record at ``layout.quarantine_key(key)``, signed in a
        signed run, which a restarted syncer believes (``_believe_report``) instead of
        downloading and validating the object again."""
        self.bad_keys.add(key)
        self.num_quarantined += 1
        log.warning("quarantined %s/%s: %s", self.store.url, key, reason)
        extra = {} if size is None else {"size": size}
        rec = records.make("quarantine", key=key, reason=reason[:4096], syncer_id=self.syncer_id, epoch=self.epoch(),
                           created_s=self.clock.time(), **extra)
        rkey = layout.quarantine_key(key)
        if self.signer is not None:
            rec = signing.sign_record(rec, run_id=self.run_id, key=rkey, signer=self.signer)
        self.store.put_if_absent(rkey, records.dumps(rec))

    def _believe_report(self, info: ObjectInfo) -> bool:
        """Whether a report found at start quarantines ``info`` without validating it: the
        report names this key and this size, and (signed runs) a syncer of the run signed it.
        Anything else (unreadable, unsigned, another size) is forgotten: the object is
        validated as if no report existed. Each report is read at most once."""
        rinfo = self._reports.pop(info.key, None) if self._reports else None
        if rinfo is None:
            return False
        try:
            rec = records.loads(self.store.get(rinfo.key, max_bytes=QUARANTINE_REPORT_MAX_BYTES), "quarantine",
                                where=f"{self.store.url}/{rinfo.key}")
            if rec["key"] != info.key or rec.get("size", info.size) != info.size:
                return False
            self.judge.trust.check_record(rec, key=rinfo.key, role="syncer")
        except (NotFound, UnreadableObjectError, ProtocolError, InvalidPayloadError):
            return False
        self.bad_keys.add(info.key)
        self.reports_believed += 1
        return True

    def load(self, p: int, info: ObjectInfo, learner_id: str, seq: int) -> Contribution | None:
        """The validated contribution, or None: invalid (then quarantined) or gone."""
        return self._validate(p, info, learner_id, seq, self._fetch(p, info.key, learner_id))

    def load_all(self, p: int, items: list[tuple[ObjectInfo, str, int]]) -> Iterator[Contribution | None]:
        """``load(p, info, learner_id, seq)`` of each item, yielded in the items' order; None
        at once for one a believed report quarantines (``_believe_report``: the reports are
        read as their objects come up, so a restart's share of a junk flood is bounded per
        poll like the flood). The downloads and decodes (zstd and torch release the GIL) run
        ahead in a small thread pool while the caller takes the earlier ones; everything that
        decides what happens to a contribution (signature, header checks, quarantine) runs
        here, in order, so the outcome is the same as loading them one by one."""
        believed = {info.key for info, _, _ in items if self._believe_report(info)}
        loads = self._load_each(p, [item for item in items if item[0].key not in believed])
        for info, _, _ in items:
            yield None if info.key in believed else next(loads)

    def _load_each(self, p: int, items: list[tuple[ObjectInfo, str, int]]) -> Iterator[Contribution | None]:
        if len(items) <= 1 or self.decode_threads <= 1:
            for info, learner_id, seq in items:
                yield self.load(p, info, learner_id, seq)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.decode_threads, thread_name_prefix="intake-decode")
        futures: list[Future[_Fetched]] = [self._pool.submit(self._fetch, p, info.key, lid) for info, lid, _ in items]
        try:
            for (info, learner_id, seq), fut in zip(items, futures):
                yield self._validate(p, info, learner_id, seq, fut.result())
        finally:  # the caller stopped early (an error): do not decode the rest
            for fut in futures:
                fut.cancel()

    def _fetch(self, p: int, key: str, learner_id: str) -> _Fetched:
        """Download one contribution, check its signature on the raw bytes [A2] and only then
        decode it; thread-safe (reads only). Errors are returned, not raised, for
        ``_validate`` to report in order."""
        admitted = self.judge.admitted(learner_id, where=f"{self.store.url}/{key}")
        if not admitted.accepted:  # not read at all: a fake id's junk costs its report only
            return _Fetched(b"", signature=admitted)
        try:
            data = self.store.get(key)
        except NotFound:
            return _Fetched()
        except UnreadableObjectError as exc:  # over its size bound, or not a regular file: never read
            return _Fetched(error=exc)
        signature = self.judge.signature(data, key=key, learner_id=learner_id, where=f"{self.store.url}/{key}")
        if not signature.accepted:  # junk costs a hash and a verify, never a zstd or dequantise
            return _Fetched(data, signature=signature)
        try:
            tensors, header = codec.decode_tensors(data, expected=expected_shapes(self.plan, p),
                                                   max_numel=self.plan.fragment_numel(p),
                                                   where=f"{self.store.url}/{key}", keep_codes=True)
        except InvalidPayloadError as exc:
            return _Fetched(data, error=exc, signature=signature)
        return _Fetched(data, tensors, header, delta_norm(tensors), signature=signature)

    def _validate(self, p: int, info: ObjectInfo, learner_id: str, seq: int, got: _Fetched) -> Contribution | None:
        """The contribution, or None: gone, or judged invalid (then quarantined)."""
        key = info.key
        if got.data is None:
            if got.error is not None:
                self.quarantine(key, str(got.error), size=info.size)
            return None
        data = got.data
        self.bytes_in += len(data)
        verdict = got.signature
        if verdict.accepted:
            verdict = self.judge.payload(data, fragment=p, key=key, learner_id=learner_id, seq=seq,
                                         where=f"{self.store.url}/{key}", signature_checked=True,
                                         decoded=got.error if got.error is not None else (got.tensors, got.header))
        if not verdict.accepted:
            self.quarantine(key, verdict.reason, size=info.size)
            return None
        header = got.header
        return Contribution(learner_id, seq, key, records.sha256_hex(data), len(data), int(header["base_version"]),
                            int(header["c_tokens"]), int(header["c_steps"]), got.tensors, norm=got.norm)

    def fetch_used(self, p: int, key: str, sha256: str) -> Tensors:
        """The tensors of the contribution a used ledger entry names, checked against its sha256."""
        return fetch_contribution(self.store, self.plan, p, key, sha256)
