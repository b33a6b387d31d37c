"""The syncer: owns the global fragments and the outer optimizer.

One loop (``Syncer.serve``): claim the lease (epoch), restore state, then poll
the bucket for contributions; for each fragment whose quorum is met and whose
grace window has passed, merge (token-weighted RDA), take an outer Nesterov
step, upload the payloads and commit the next version's manifest.

The commit decision is ``ready_to_merge``; everything else is I/O around it.
"""

from __future__ import annotations

import logging
import os
import socket
import statistics
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ddiloco_cli import codec, layout, ledger, records, signing
from ddiloco_cli.errors import DdilocoError, InvalidPayloadError, ProtocolError
from ddiloco_cli.fence import FencedStore, fence_interval_s
from ddiloco_cli.merge import is_embedding_key, merge_outer_gradients, token_weight
from ddiloco_cli.outer import OuterOptimizer
from ddiloco_cli.published import FragmentReader, encode_version, expected_shapes, upload_payloads
from ddiloco_cli.store.base import NotFound, ObjectInfo, Store, UnreadableObjectError

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]
RESTORE_RETRY_S = 30.0  # how often a fragment whose committed state is unreadable is tried again


@dataclass
class SyncerOptions:
    fragments: list[int] | None = None  # None: all
    syncer_id: str = ""
    poll_s: float = 0.2
    gc: bool = True
    gc_every_s: float = 30.0
    max_versions: int | None = None  # stop after committing this many versions (tests, benchmarks)
    max_runtime_s: float | None = None
    key_path: str | None = None  # signing key admitted with role syncer (runs that require signatures)


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

    @property
    def weight(self) -> float:
        return token_weight(self.c_tokens, self.c_steps)

    def ledger_entry(self, *, used: bool, reason: str = "") -> dict[str, Any]:
        entry = {
            "learner_id": self.learner_id, "seq": self.seq, "key": self.key, "sha256": self.sha256,
            "size": self.size, "base_version": self.base_version, "c_tokens": self.c_tokens,
            "c_steps": self.c_steps, "weight": self.weight, "used": used,
        }
        if reason:
            entry["reason"] = reason
        return entry


@dataclass
class FragmentState:
    fragment: int
    version: int
    value: Tensors  # the exact published value of `version`
    outer: OuterOptimizer
    high_water: dict[str, int]
    history: OrderedDict[int, Tensors] = field(default_factory=OrderedDict)
    pending: dict[str, Contribution] = field(default_factory=dict)
    superseded: list[dict[str, Any]] = field(default_factory=list)  # ledger entries
    seen: set[str] = field(default_factory=set)
    first_pending_t: float | None = None
    quorum_t: float | None = None
    last_quorum_size: int = 0


def ready_to_merge(
    *, num_pending: int, quorum: int, now_t: float, first_pending_t: float | None, quorum_t: float | None,
    step_time_s: float | None, overlap_steps: int, sync_time_s: float, grace_gamma: float, grace_max_s: float,
    all_live_reported: bool,
) -> tuple[bool, float]:
    """The commit decision for one fragment. Returns (merge now?, grace window in s).

    Merge once ``quorum`` distinct learners have reported, after a grace window
    that waits only as long as the learners' overlap can hide:
    ``grace = min(grace_max_s, gamma * max(0, tau * step_time - (time_to_quorum + time_to_sync)))``.
    If every live learner has reported there is nothing to wait for.
    """
    if num_pending < quorum or quorum_t is None:
        return False, 0.0
    if all_live_reported:
        return True, 0.0
    time_to_quorum = quorum_t - (first_pending_t if first_pending_t is not None else quorum_t)
    slack = overlap_steps * (step_time_s or 0.0) - (time_to_quorum + sync_time_s)
    grace = min(grace_max_s, grace_gamma * max(0.0, slack))
    return now_t - quorum_t >= grace, grace


class Syncer:
    def __init__(self, store: Store, *, options: SyncerOptions, on_progress: Callable[[dict], None] | None = None):
        self.store = store
        self.opts = options
        self.run = ledger.read_run(store)
        self.run_id = self.run["run_id"]
        self.plan = ledger.read_plan(store, run_id=self.run_id)
        all_frags = list(range(self.plan.num_fragments))
        self.fragments = sorted(options.fragments) if options.fragments is not None else all_frags
        bad = [p for p in self.fragments if p not in all_frags]
        if bad:
            raise ProtocolError(f"fragments {bad} do not exist in this run (it has {self.plan.num_fragments})")
        self.syncer_id = options.syncer_id or f"{socket.gethostname()}-{os.getpid()}"
        # signed runs [A2][A3][A5]: what this syncer accepts, and the key it signs epochs and manifests with
        self.trust = signing.Trust(store, run=self.run)
        self.signer = signing.signer_for_run(store, run=self.run, key_path=options.key_path, member_id=None, role="syncer")
        self.on_progress = on_progress
        self.epoch: ledger.Epoch | None = None
        self.states: dict[int, FragmentState] = {}
        self.readers = {p: FragmentReader(store, run_id=self.run_id, plan=self.plan, fragment=p, trust=self.trust)
                        for p in self.fragments}
        self.bad_keys: set[str] = set()
        self.sync_time_s = 0.0  # EMA of merge + commit time
        self.step_time_s: float | None = None
        self.live_learners: set[str] = set()
        self.known_learners: set[str] = set()
        self.num_merges = 0
        self.num_quarantined = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self._last_beat_t = 0.0
        self._last_learners_t = 0.0
        self._last_fence_check_t = 0.0
        self._last_gc_t = time.monotonic()
        self.unavailable: dict[int, str] = {}  # fragments whose committed state cannot be read: why
        self._last_restore_t = time.monotonic()

    # ------------------------------------------------------------------ lease
    def acquire(self, *, stop: Callable[[], bool] = lambda: False) -> bool:
        """Stand by until the fragments' lease is free or expired, then claim the next epoch."""
        lease_s = float(self.run["lease_s"])
        announced = None
        while not stop():
            owner = ledger.current_owner(self.store, run_id=self.run_id, fragments=self.fragments, trust=self.trust)
            if owner is not None:
                age = ledger.syncer_heartbeat_age(self.store, owner.epoch)
                if age is None:
                    infos = self.store.list(layout.epoch_key(owner.epoch))
                    age = self.store.now() - infos[0].mtime_s if infos else lease_s + 1
                state = self._owner_state(owner.epoch)
                if state in ("serving", None) and age <= lease_s:  # a stopped owner frees the lease at once
                    if announced != owner.epoch:
                        log.info("standing by: epoch %d (%s) holds the lease (heartbeat %.1fs ago, lease %.0fs)",
                                 owner.epoch, owner.syncer_id, age, lease_s)
                        announced = owner.epoch
                    time.sleep(min(1.0, float(self.run["heartbeat_s"])))
                    continue
            self.epoch = ledger.claim_epoch(
                self.store, run_id=self.run_id, syncer_id=self.syncer_id, fragments=self.fragments,
                created_s=time.time(), stop=stop, signer=self.signer,
            )
            if self.epoch is None:
                return False
            # the one place the syncer's store is wrapped: from here on every write checks the fence
            self.store = FencedStore(self.store, run_id=self.run_id, epoch=self.epoch, interval_s=fence_interval_s(lease_s),
                                     trust=self.trust)
            self.heartbeat(force=True)
            log.info("claimed epoch %d for fragments %s", self.epoch.epoch, _spec(self.fragments))
            return True
        return False

    def _owner_state(self, epoch: int) -> str | None:
        try:
            rec = records.loads(self.store.get(layout.syncer_heartbeat_key(epoch)), "syncer_heartbeat", where="heartbeat")
            return rec["state"]
        except (NotFound, ProtocolError):
            return None

    def check_fence(self) -> None:
        """Raise FencedError if a higher epoch overlapping our fragments exists."""
        assert isinstance(self.store, FencedStore)
        self.store.check_fence()
        self._last_fence_check_t = time.monotonic()

    def heartbeat(self, *, force: bool = False, state: str = "serving") -> None:
        now = time.monotonic()
        if not force and now - self._last_beat_t < float(self.run["heartbeat_s"]):
            return
        assert self.epoch is not None
        rec = records.make(
            "syncer_heartbeat", run_id=self.run_id, epoch=self.epoch.epoch, syncer_id=self.syncer_id,
            fragments=self.fragments, state=state,
            versions={str(p): s.version for p, s in self.states.items()},
            quorum_sizes={str(p): s.last_quorum_size for p, s in self.states.items()},
            num_merges=self.num_merges, num_quarantined=self.num_quarantined, time_s=time.time(),
        )
        self.store.put(layout.syncer_heartbeat_key(self.epoch.epoch), records.dumps(rec))
        self._last_beat_t = now

    def _refresh_learners(self) -> None:
        """Which learners are live, and their median step time (for the grace window)."""
        self._last_learners_t = time.monotonic()
        beats = [b for b in ledger.read_heartbeats(self.store, layout.LEARNER_HEARTBEAT_PREFIX, "learner_heartbeat")
                 if self.trust.admits(b.record, key=b.key, role="learner", member_id=b.record["learner_id"])]  # [A3]
        lease_s = float(self.run["lease_s"])
        self.known_learners = {b.record["learner_id"] for b in beats}
        live = [b for b in beats if b.record["state"] == "running" and b.age_s <= lease_s]
        self.live_learners = {b.record["learner_id"] for b in live}
        times = [b.record["step_time_s"] for b in live if b.record.get("step_time_s")]
        self.step_time_s = statistics.median(times) if times else None

    # ---------------------------------------------------------------- restore
    def restore(self) -> None:
        """Load every owned fragment: latest published value, momentum from the newest
        checkpoint plus replay of the manifests after it, and the merged high-water marks."""
        for info in self.store.list(layout.QUARANTINE_PREFIX):
            if (original := layout.parse_quarantine_key(info.key)) is not None:
                self.bad_keys.add(original)
        errors = [exc for p in self.fragments if (exc := self._try_restore(p)) is not None]
        if not self.states and errors:
            raise errors[0]  # nothing to serve (e.g. an interrupted init): say why

    def _try_restore(self, p: int) -> DdilocoError | None:
        """Restore fragment p; if its committed state cannot be read (a corrupt manifest
        or payload), log why and leave it out, so the other fragments are still served;
        ``serve`` retries it every ``RESTORE_RETRY_S``."""
        try:
            self.states[p] = self._restore_fragment(p)
        except (NotFound, InvalidPayloadError, ProtocolError) as exc:
            error = exc if isinstance(exc, DdilocoError) else ProtocolError(f"fragment {p}: {exc}")
            if self.unavailable.get(p) != str(error):
                log.error("fragment %d cannot be served: %s (serving the others; retrying every %.0f s)",
                          p, error, RESTORE_RETRY_S)
            self.unavailable[p] = str(error)
            return error
        self.unavailable.pop(p, None)
        log.info("fragment %d at version %d (%d outer steps)", p, self.states[p].version, self.states[p].outer.num_steps)
        return None

    def _new_outer(self) -> OuterOptimizer:
        return OuterOptimizer(lr=float(self.run["outer_lr"]), momentum=float(self.run["outer_momentum"]))

    def _restore_fragment(self, p: int) -> FragmentState:
        reader = self.readers[p]
        latest = ledger.latest_version(self.store, p)
        if latest is None:
            raise ProtocolError(f"{self.store.url}: fragment {p} has no committed version (was `ddiloco init` interrupted?)")
        manifest = reader.manifest(latest)
        outer = self._new_outer()
        start = self._load_checkpoint(p, latest, outer)
        value = None
        if start is not None and start < latest:
            value = self._replay(p, start, latest, outer)
        if value is None:
            value = reader.read(latest)
        state = FragmentState(p, latest, value, outer, dict(manifest["high_water"]))
        state.history[latest] = value
        return state

    def _load_checkpoint(self, p: int, latest: int, outer: OuterOptimizer) -> int | None:
        """Load the newest valid checkpoint at or below ``latest``; return its version
        (0 with fresh state when none: version 0 has no momentum)."""
        infos = sorted(self.store.list(layout.checkpoint_prefix(p)), key=lambda i: i.key, reverse=True)
        for info in infos:
            v = layout.parse_num(info.key)
            if v is None or v > latest:
                continue
            try:
                tensors, meta = codec.decode_tensors(self.store.get(info.key), expected=expected_shapes(self.plan, p), where=f"{self.store.url}/{info.key}")
                records.validate(meta, "checkpoint", where=info.key)
                if meta["run_id"] != self.run_id or meta["fragment"] != p or meta["version"] != v:
                    raise ProtocolError(f"{info.key}: checkpoint header does not match its name or run")
            except (NotFound, InvalidPayloadError, ProtocolError) as exc:
                log.warning("skipping checkpoint %s: %s", info.key, exc)
                continue
            outer.load_state_tensors(tensors)
            outer.num_steps = int(meta["outer_steps"])
            return v
        return 0

    def _replay(self, p: int, start: int, latest: int, outer: OuterOptimizer) -> Tensors | None:
        """Recompute the outer momentum from version ``start`` to ``latest`` from the
        ledger. Returns the published value at ``latest``, or None if replay was
        impossible (missing contributions): momentum is then left at the checkpoint's."""
        reader = self.readers[p]
        values: dict[int, Tensors] = {start: reader.read(start)}
        try:
            for v in range(start + 1, latest + 1):
                m = reader.manifest(v)
                current = values[v - 1]
                used = [c for c in m["contributions"] if c["used"]]
                grads, weights = [], []
                for c in used:
                    delta = self._fetch_contribution_tensors(p, c)
                    base = values.get(c["base_version"]) or reader.read(c["base_version"])
                    grads.append(self._outer_gradient(current, base, delta, same_base=c["base_version"] == v - 1))
                    weights.append(float(c["weight"]))
                if grads:
                    merged = self._merge(grads, weights)
                    raw = {k: t.clone() for k, t in current.items()}
                    outer.lr = float(m.get("outer_lr", self.run["outer_lr"]))
                    outer.step(raw, merged)
                values[v] = reader.read(v, have=(v - 1, current))
                for old in [u for u in values if u < v - int(self.run["max_staleness"]) - 1]:
                    del values[old]
            return values[latest]
        except (NotFound, InvalidPayloadError, ProtocolError) as exc:
            log.error("fragment %d: cannot replay the ledger from checkpoint %d (%s); continuing with the "
                      "checkpoint's momentum, which lags the committed trajectory", p, start, exc)
            return None

    def _fetch_contribution_tensors(self, p: int, entry: dict[str, Any]) -> Tensors:
        key = entry["key"]
        data = self.store.get(key)
        if records.sha256_hex(data) != entry["sha256"]:
            raise InvalidPayloadError(f"{key}: sha256 differs from the ledger")
        tensors, _ = codec.decode_tensors(data, expected=expected_shapes(self.plan, p),
                                          max_numel=self.plan.fragment_numel(p), where=key)
        return tensors

    # ------------------------------------------------------------------ merge
    @staticmethod
    def _outer_gradient(current: Tensors, base: Tensors, delta: Tensors, *, same_base: bool) -> Tensors:
        # v_m = current - theta_m = (current - base_m) + delta_m
        if same_base:
            return delta
        return {k: (current[k] - base[k]) + delta[k] for k in current}

    def _merge(self, grads: list[Tensors], weights: list[float]) -> Tensors:
        if len(grads) == 1:  # a single contribution passes through unchanged, bit for bit
            return grads[0]
        mean_keys = {k for k in grads[0] if is_embedding_key(k)}
        return merge_outer_gradients(grads, weights, method=self.run["merge"], mean_keys=mean_keys)

    def _outer_lr(self, num_merged: int) -> float:
        """The outer learning rate of one merge. With outer_lr_scaling = "participation",
        a merge of m out of M live learners steps with lr * m / M: learners out of phase
        (each merged on its own) then move the fragment as far per cycle as one merge
        of all of them, instead of M times as far."""
        lr = float(self.run["outer_lr"])
        if self.run.get("outer_lr_scaling", "none") == "participation" and self.live_learners:
            lr *= min(1.0, num_merged / len(self.live_learners))
        return lr

    def _base_value(self, state: FragmentState, version: int) -> Tensors:
        if version in state.history:
            return state.history[version]
        value = self.readers[state.fragment].read(version)
        state.history[version] = value
        state.history.move_to_end(version, last=False)
        return value

    # ------------------------------------------------------------ contributions
    def _quarantine(self, key: str, reason: str) -> None:
        self.bad_keys.add(key)
        self.num_quarantined += 1
        log.warning("quarantined %s/%s: %s", self.store.url, key, reason)
        rec = records.make("quarantine", key=key, reason=reason, syncer_id=self.syncer_id,
                           epoch=self.epoch.epoch if self.epoch else 0, created_s=time.time())
        self.store.put_if_absent(layout.quarantine_key(key), records.dumps(rec))

    def poll_contributions(self) -> None:
        """One LIST for all owned fragments (one per fragment would cost P LISTs a poll)."""
        if len(self.fragments) == 1:
            infos = self.store.list(layout.contribution_prefix(self.fragments[0]))
        else:
            infos = self.store.list(layout.CONTRIBUTION_ROOT)
        by_fragment: dict[int, list[ObjectInfo]] = {p: [] for p in self.states}
        for info in infos:
            p = layout.parse_fragment_dir(info.key)
            if p in by_fragment:
                by_fragment[p].append(info)
        for p, keys in by_fragment.items():
            self._take_contributions(self.states[p], keys)

    def _take_contributions(self, state: FragmentState, infos: list[ObjectInfo]) -> None:
        """Load at most one new contribution per learner: its newest valid one. Older
        unmerged ones are superseded (the newest carries the learner's progress against
        its base) and go into the ledger as such without being downloaded."""
        p = state.fragment
        fresh: dict[str, list[tuple[int, ObjectInfo]]] = {}
        for info in infos:
            key = info.key
            if key in state.seen or key in self.bad_keys:
                continue
            parsed = layout.parse_contribution_key(key)
            if parsed is None or parsed[0] != p or not layout.valid_learner_id(parsed[1]):
                self._quarantine(key, "not a valid contribution name")
                continue
            _, learner_id, seq = parsed
            state.seen.add(key)
            if seq > state.high_water.get(learner_id, -1):  # else already merged or superseded
                fresh.setdefault(learner_id, []).append((seq, info))
        for learner_id, items in fresh.items():
            items.sort(key=lambda item: item[0], reverse=True)
            current = state.pending.get(learner_id)
            for i, (seq, info) in enumerate(items):
                if current is not None and seq < current.seq:
                    state.superseded.extend(_superseded_entry(learner_id, s, o) for s, o in items[i:])
                    break
                contribution = self._load_contribution(state, info.key, learner_id, seq)
                if contribution is None:
                    continue
                state.superseded.extend(_superseded_entry(learner_id, s, o) for s, o in items[i + 1:])
                if current is not None:
                    state.superseded.append(_superseded_entry(learner_id, current.seq, current))
                state.pending[learner_id] = contribution
                if state.first_pending_t is None:
                    state.first_pending_t = time.monotonic()
                break

    def _load_contribution(self, state: FragmentState, key: str, learner_id: str, seq: int) -> Contribution | None:
        p = state.fragment
        where = f"{self.store.url}/{key}"
        try:
            data = self.store.get(key)
        except NotFound:
            return None  # garbage-collected or never finished: nothing to do
        except UnreadableObjectError as exc:  # over its size bound, or not a regular file: never read
            self._quarantine(key, str(exc))
            return None
        self.bytes_in += len(data)
        try:
            self.trust.check_payload(data, kind="contribution", key=key, member_id=learner_id, where=where)  # [A2]
            tensors, header = codec.decode_tensors(data, expected=expected_shapes(self.plan, p),
                                                   max_numel=self.plan.fragment_numel(p), where=where)
            records.validate(header, "contribution", where=where)
            if header["run_id"] != self.run_id:
                raise InvalidPayloadError(f"{where}: belongs to run {header['run_id']}, not this run")
            if (header["fragment"], header["learner_id"], header["seq"]) != (p, learner_id, seq):
                raise InvalidPayloadError(f"{where}: header names fragment {header['fragment']} learner "
                                          f"{header['learner_id']} seq {header['seq']}, not its key")
            if header["base_version"] > state.version:
                self.check_fence()  # a base it never committed: another syncer commits (then it stops), or a lie
                raise InvalidPayloadError(f"{where}: base version {header['base_version']} is newer than "
                                          f"the committed version {state.version}")
        except (InvalidPayloadError, ProtocolError) as exc:
            self._quarantine(key, str(exc))
            return None
        if learner_id not in self.known_learners:
            self._refresh_learners()
            if learner_id not in self.known_learners:
                self._quarantine(key, f"unknown learner {learner_id!r} (no heartbeat in the run)")
                return None
        return Contribution(learner_id, seq, key, records.sha256_hex(data), len(data),
                            int(header["base_version"]), int(header["c_tokens"]), int(header["c_steps"]), tensors)

    # ------------------------------------------------------------------ commit
    def maybe_merge(self, state: FragmentState) -> bool:
        # stale contributions, or ones whose base can no longer be read, are quarantined before counting
        max_stale = int(self.run["max_staleness"])
        for lid, c in list(state.pending.items()):
            reason = None
            if c.base_version < state.version - max_stale:
                reason = f"stale: base version {c.base_version}, current {state.version}, max staleness {max_stale}"
            elif c.base_version != state.version:
                try:
                    self._base_value(state, c.base_version)
                except (NotFound, InvalidPayloadError, ProtocolError) as exc:
                    reason = f"base version {c.base_version} can no longer be read ({exc})"
            if reason is not None:
                del state.pending[lid]
                self._quarantine(c.key, reason)
        now_t = time.monotonic()
        quorum = int(self.run["quorum"])
        if len(state.pending) >= quorum and state.quorum_t is None:
            state.quorum_t = now_t
        all_live = bool(self.live_learners) and self.live_learners <= set(state.pending)
        go, grace = ready_to_merge(
            num_pending=len(state.pending), quorum=quorum, now_t=now_t, first_pending_t=state.first_pending_t,
            quorum_t=state.quorum_t, step_time_s=self.step_time_s, overlap_steps=int(self.run["overlap_steps"]),
            sync_time_s=self.sync_time_s, grace_gamma=float(self.run["grace_gamma"]),
            grace_max_s=float(self.run["grace_max_s"]), all_live_reported=all_live,
        )
        if not go:
            return False
        return self.commit(state, grace_s=grace)

    def commit(self, state: FragmentState, *, grace_s: float) -> bool:
        """Merge the pending contributions into the next version. Returns False when
        another syncer committed that version first (state is then reloaded)."""
        t0 = time.monotonic()
        p = state.fragment
        contributions = sorted(state.pending.values(), key=lambda c: (c.learner_id, c.seq))
        grads = [self._outer_gradient(state.value, self._base_value(state, c.base_version), c.delta,
                                      same_base=c.base_version == state.version) for c in contributions]
        merged = self._merge(grads, [c.weight for c in contributions])
        outer = state.outer
        momentum_before = outer.state_tensors()
        steps_before = outer.num_steps
        raw = {k: t.clone() for k, t in state.value.items()}
        outer.lr = self._outer_lr(len(contributions))
        outer.step(raw, merged)
        version = state.version + 1
        encoded = encode_version(
            fragment=p, version=version, new_value=raw, prev_published=state.value,
            publish_codec=self.run["publish_codec"], block_size=int(self.run["codec_block"]),
            keyframe_every=int(self.run["keyframe_every"]),
        )
        high_water = dict(state.high_water)
        for c in contributions:
            high_water[c.learner_id] = max(high_water.get(c.learner_id, -1), c.seq)
        for e in state.superseded:
            high_water[e["learner_id"]] = max(high_water.get(e["learner_id"], -1), e["seq"])
        manifest = records.make(
            "manifest", run_id=self.run_id, fragment=p, version=version, epoch=self.epoch.epoch,
            syncer_id=self.syncer_id, nonce=records.new_nonce(), created_s=time.time(),
            numel=self.plan.fragment_numel(p), payloads=[e for _, _, e in encoded.payloads],
            contributions=[c.ledger_entry(used=True) for c in contributions]
            + state.superseded,
            quorum_size=len(contributions), grace_s=grace_s, outer_steps=outer.num_steps, high_water=high_water,
            outer_lr=outer.lr,
        )
        if self.signer is not None:  # [A5]
            manifest = signing.sign_record(manifest, run_id=self.run_id, key=layout.manifest_key(p, version),
                                           signer=self.signer)
        self.bytes_out += upload_payloads(self.store, encoded)
        # a pause (GC, SIGSTOP, preemption) since our last lease check may have let a standby take over
        if time.monotonic() - self._last_fence_check_t > float(self.run["lease_s"]) / 2:
            self.check_fence()
            self.heartbeat(force=True)
        if not ledger.commit_manifest(self.store, manifest):
            outer.load_state_tensors(momentum_before)
            outer.num_steps = steps_before
            self.check_fence()
            log.warning("fragment %d: version %d was committed by another syncer; reloading", p, version)
            reloaded = self._restore_fragment(p)
            reloaded.seen = state.seen
            reloaded.pending = {lid: c for lid, c in state.pending.items() if c.seq > reloaded.high_water.get(lid, -1)}
            self.states[p] = reloaded
            return False
        state.version = version
        state.value = encoded.published
        state.history[version] = encoded.published
        while len(state.history) > int(self.run["max_staleness"]) + 1:
            state.history.popitem(last=False)
        state.high_water = high_water
        state.pending.clear()
        state.superseded.clear()
        state.seen = {k for k in state.seen if _above_high_water(k, high_water)}
        state.first_pending_t = state.quorum_t = None
        state.last_quorum_size = len(contributions)
        self.num_merges += 1
        if version % int(self.run["checkpoint_every"]) == 0:
            self.write_checkpoint(state)
        dt = time.monotonic() - t0
        self.sync_time_s = dt if self.sync_time_s == 0 else 0.8 * self.sync_time_s + 0.2 * dt
        log.info("fragment %d -> version %d (quorum %d, grace %.2fs, %.0f ms)", p, version, len(contributions), grace_s, dt * 1e3)
        return True

    def write_checkpoint(self, state: FragmentState) -> None:
        header = records.make(
            "checkpoint", run_id=self.run_id, fragment=state.fragment, version=state.version, epoch=self.epoch.epoch,
            outer_steps=state.outer.num_steps, nonce=records.new_nonce(),
        )
        data = codec.encode_tensors(state.outer.state_tensors(), codec="none", metadata=header)
        self.store.put_if_absent(layout.checkpoint_key(state.fragment, state.version, header["nonce"][:12]), data)
        self.bytes_out += len(data)

    # ------------------------------------------------------------------- loop
    def serve(self, *, stop: Callable[[], bool] = lambda: False) -> str:
        """Claim, restore and serve until stopped, fenced or a limit is reached.

        Returns why it ended: "stopped", "limit". Raises FencedError when fenced.
        """
        t_start = time.monotonic()

        def out_of_time() -> bool:  # --max-runtime bounds standing by too
            return self.opts.max_runtime_s is not None and time.monotonic() - t_start > self.opts.max_runtime_s

        if not self.acquire(stop=lambda: stop() or out_of_time()):
            return "limit" if out_of_time() else "stopped"
        self.check_fence()
        self.restore()
        self.heartbeat(force=True)
        committed = 0
        try:
            while not stop():
                if time.monotonic() - self._last_fence_check_t > max(1.0, float(self.run["heartbeat_s"])):
                    self.check_fence()
                self.heartbeat()
                if time.monotonic() - self._last_learners_t > float(self.run["heartbeat_s"]):
                    self._refresh_learners()
                self.poll_contributions()
                for state in list(self.states.values()):
                    if self.maybe_merge(state):
                        committed += 1
                if self.unavailable and time.monotonic() - self._last_restore_t > RESTORE_RETRY_S:
                    self._last_restore_t = time.monotonic()
                    for p in sorted(self.unavailable):
                        self._try_restore(p)
                if self.on_progress is not None:
                    self.on_progress(self.progress())
                if self.opts.max_versions is not None and committed >= self.opts.max_versions:
                    return "limit"
                if out_of_time():
                    return "limit"
                if self.opts.gc and time.monotonic() - self._last_gc_t > self.opts.gc_every_s:
                    self._collect_garbage()
                time.sleep(self.opts.poll_s)
            return "stopped"
        finally:
            try:
                self.heartbeat(force=True, state="stopped")
            except Exception as exc:  # noqa: BLE001 - best effort on the way out
                log.debug("final heartbeat failed: %s", exc)

    def _collect_garbage(self) -> None:
        from ddiloco_cli.gc import collect_garbage

        self._last_gc_t = time.monotonic()
        self.unavailable: dict[int, str] = {}  # fragments whose committed state cannot be read: why
        self._last_restore_t = time.monotonic()
        try:
            collect_garbage(self.store, run=self.run, fragments=self.fragments)
        except Exception as exc:  # noqa: BLE001 - GC must never stop serving
            log.warning("garbage collection failed: %s", exc)

    def progress(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch.epoch if self.epoch else None,
            "versions": {p: s.version for p, s in self.states.items()},
            "pending": {p: len(s.pending) for p, s in self.states.items()},
            "quorum_sizes": {p: s.last_quorum_size for p, s in self.states.items()},
            "num_merges": self.num_merges, "num_quarantined": self.num_quarantined,
            "live_learners": len(self.live_learners), "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
        }


def _superseded_entry(learner_id: str, seq: int, obj: "ObjectInfo | Contribution") -> dict[str, Any]:
    return {"learner_id": learner_id, "seq": seq, "key": obj.key, "size": obj.size, "used": False, "reason": "superseded"}


def _above_high_water(key: str, high_water: dict[str, int]) -> bool:
    parsed = layout.parse_contribution_key(key)
    return parsed is None or parsed[2] > high_water.get(parsed[1], -1)


def _spec(frags: list[int]) -> str:
    return ",".join(str(p) for p in frags) if len(frags) <= 8 else f"{frags[0]}..{frags[-1]} ({len(frags)})"
