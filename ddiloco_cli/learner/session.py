"""A learner session's records in the bucket: ``learners/ID/heartbeat.json`` (who
holds the id, and observability) and ``learners/ID/state.json`` (where its data
stream stands), and the alerts its heartbeat thread raises.

One live session per learner id: a session starts only when the id's heartbeat
is not ``running`` within the lease, and it re-reads the record before a
heartbeat write whenever a newer session may have started (``SessionWriter.beat``);
when a newer session holds the id, the older one stops writing and leaves (the
newer one won a start race, or found this one's heartbeat past the lease, e.g.
after a SIGSTOP).

``heartbeat_bytes`` is the one place where a heartbeat's bytes are made (and, in
a run that requires signatures, signed: PROTOCOL.md, "Signatures", [A3]).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from ddiloco_cli.errors import DdilocoError, UsageError
from ddiloco_cli.protocol import layout, ledger, records, signing
from ddiloco_cli.store.base import NotFound, Store

log = logging.getLogger(__name__)

MAX_STATE_BYTES = 64 * 1024  # a data position, not a dataset: larger states are refused
LEASE_MARGIN_S = 0.5  # past the lease by the store's clock, whose object times may be coarse


@dataclass(frozen=True)
class HeldBy:
    """The learner heartbeat at an id's key and its age by the store's clock."""

    record: dict[str, Any]
    age_s: float


def heartbeat_bytes(record: dict[str, Any], *, signer: signing.Signer | None = None) -> bytes:
    if signer is not None:
        record = signing.sign_record(record, run_id=record["run_id"],
                                     key=layout.learner_heartbeat_key(record["learner_id"]), signer=signer)
    return records.dumps(record)


def _read_record(store: Store, learner_id: str) -> dict[str, Any] | None:
    key = layout.learner_heartbeat_key(learner_id)
    try:
        return records.loads(store.get(key), "learner_heartbeat", where=f"{store.url}/{key}")
    except NotFound:
        return None
    except DdilocoError as exc:
        log.warning("%s", exc)
        return None


def read_heartbeat(store: Store, learner_id: str, *, lease_s: float | None = None) -> HeldBy | None:
    """The id's heartbeat and its store age (infinite when dated more than ``lease_s`` ahead:
    ``ledger.heartbeat_age``), or None when absent or unreadable."""
    key = layout.learner_heartbeat_key(learner_id)
    infos = [i for i in store.list(key) if i.key == key]
    rec = _read_record(store, learner_id) if infos else None
    if rec is None:
        return None
    return HeldBy(rec, ledger.heartbeat_age(store.now(), infos[0].mtime_s, lease_s=lease_s))


def describe(held: HeldBy) -> str:
    rec = held.record
    return (f"session {rec.get('session', '?')} on host {rec.get('host', '?')} (pid {rec.get('pid', '?')}), "
            f"last heartbeat {held.age_s:.1f}s ago")


def _crashed_here(rec: dict[str, Any], me: tuple[str, int] | None = None) -> bool:
    """The session ran on this host and its process is gone (or is this very process,
    as after a container restart): a crash, not a live twin. ``me``: this process's
    (host, pid) if not the real ones (the simulation's learners have a fixed one)."""
    host, my_pid = me or (socket.gethostname(), os.getpid())
    if rec.get("host") != host or not isinstance(rec.get("pid"), int):
        return False
    pid = rec["pid"]
    if pid == my_pid:
        return True
    if me is not None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, ValueError):
        return False
    return False


def _live(held: HeldBy | None, lease_s: float, me: tuple[str, int] | None = None) -> bool:
    return (held is not None and held.record["state"] == "running" and held.age_s <= lease_s
            and not _crashed_here(held.record, me))


def check_id_free(store: Store, learner_id: str, *, lease_s: float,
                  sleep: Callable[[float], None] = time.sleep, me: tuple[str, int] | None = None) -> HeldBy | None:
    """Raise UsageError when a live session holds ``learner_id``; else return the
    previous session's heartbeat (or None).

    Live: state running, a heartbeat within the lease, and not a crashed process of
    this host. A running heartbeat is watched for up to one lease first: a session
    that crashed on another machine stops beating, a live one beats again."""
    held = read_heartbeat(store, learner_id, lease_s=lease_s)
    if not _live(held, lease_s, me):
        return held
    wait_s = lease_s - held.age_s + LEASE_MARGIN_S
    log.info("learner id %r has a running heartbeat (%s); waiting %.1fs to see whether that session is alive",
             learner_id, describe(held), wait_s)
    sleep(wait_s)
    again = read_heartbeat(store, learner_id, lease_s=lease_s)
    if not _live(again, lease_s, me):
        return again
    raise UsageError(f"learner id {learner_id!r} is live: {describe(again)}. Stop that session, or pick "
                     f"another --learner-id")


def read_state(store: Store, learner_id: str) -> dict[str, Any] | None:
    """The ``data`` a previous session saved in learners/ID/state.json, or None."""
    key = layout.learner_state_key(learner_id)
    where = f"{store.url}/{key}"
    try:
        data = store.get(key)
    except NotFound:
        return None
    if len(data) > MAX_STATE_BYTES:
        log.warning("%s: %d bytes, over the %d-byte bound; starting the data stream afresh", where, len(data),
                    MAX_STATE_BYTES)
        return None
    try:
        return records.loads(data, "learner_state", where=where)["data"]
    except (DdilocoError, RecursionError, ValueError) as exc:
        log.warning("%s; starting the data stream afresh", exc)
        return None


def suspend_aware_clock() -> float:
    """Seconds on a clock that also runs while the machine is suspended (Linux's
    CLOCK_BOOTTIME; elsewhere the monotonic clock): a session woken from a suspended
    VM must see the gap, or it would write over a newer session's heartbeat unchecked."""
    return time.clock_gettime(_BOOTTIME) if _BOOTTIME is not None else time.monotonic()


_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)


class SessionWriter(threading.Thread):
    """Writes the heartbeat every ``every_s`` and the data state when it changed (at
    most every ``lease_s / 2``), and logs the stall alert the loop asked for at once.

    Requests per heartbeat (PROTOCOL.md [L2]): one PUT; the GET that checks for a
    newer session only when one may have started since the last check (see ``beat``),
    about once per ``lease_s / 2``; the data state's PUT at most once per ``lease_s / 2``."""

    def __init__(self, store: Store, *, learner_id: str, session: int, make_record: Callable[[], dict],
                 run_id: str, lease_s: float, every_s: float, signer: signing.Signer | None = None,
                 clock: Callable[[], float] | None = None):
        super().__init__(name="ddiloco-heartbeat", daemon=True)
        self.store, self.learner_id, self.session = store, learner_id, session
        self.signer = signer
        self.make_record, self.run_id, self.lease_s, self.every_s = make_record, run_id, lease_s, every_s
        self.hb_key = layout.learner_heartbeat_key(learner_id)
        self.stopping = threading.Event()
        self.wakeup = threading.Event()
        self.lock = threading.Lock()
        self.taken_over_by: HeldBy | None = None
        self.clock = clock or suspend_aware_clock
        self.started_t = self.clock()
        self._checked_t: float | None = None  # when the heartbeat was last re-read
        self._state_t: float | None = None  # when the data state was last written
        self._state: dict[str, Any] | None = None
        self._state_written: dict[str, Any] | None = None
        self._alert: str | None = None  # what is wrong; the syncer's liveness is added when logged
        self._next_beat = -math.inf  # when tick writes the next heartbeat (on self.clock)

    @property
    def check_every_s(self) -> float:
        """A newer session can only start once this one's heartbeat is a lease old: re-reading
        at half that catches it before this session wrote more than a few heartbeats over it."""
        return self.lease_s / 2

    def save_state(self, data: dict[str, Any]) -> None:
        """Write ``data`` (JSON-able) to learners/ID/state.json with a coming heartbeat:
        when it changed, at most once per lease_s / 2 however often the learner sends,
        and on close. (A resume hint: a restart replays at most that much of the stream.)"""
        with self.lock:
            self._state = data

    def alert_stalled(self, *, step: int, since_step: int) -> None:
        """Decoupled mode: no new version of any fragment since ``since_step``."""
        self._set_alert(f"no new version of any fragment in {step - since_step} steps "
                        f"(last at step {since_step}, now step {step})")

    def alert_waiting(self, *, step: int, fragment: int, waited_s: float) -> None:
        """Lock-step mode: blocked waiting for the version that merges our contribution."""
        self._set_alert(f"waited {waited_s:.0f}s at step {step} for the version of fragment {fragment} "
                        f"that merges this learner's contribution")

    def _set_alert(self, what: str) -> None:
        with self.lock:
            self._alert = what
        self.wakeup.set()

    def _check_due(self, now: float) -> bool:
        """Whether to re-read the heartbeat before writing it [L2]: during the first lease
        (a start race: two sessions that both found the id free), when the last check is
        ``check_every_s`` old (a newer session needs this one's heartbeat a lease old: a
        pause such as SIGSTOP, a long outage or a start race all pass this), and always
        on the first write."""
        return (self._checked_t is None or now - self.started_t < self.lease_s
                or now - self._checked_t >= self.check_every_s)

    def beat(self, *, check: bool | None = None) -> None:
        """Write the heartbeat unless a newer session took the id over; ``check`` forces
        (True) or skips (False) the re-read, else ``_check_due`` decides."""
        if self.taken_over_by is not None:
            return
        try:
            now = self.clock()
            if check if check is not None else self._check_due(now):
                current = _read_record(self.store, self.learner_id)  # one GET; the age only when it matters
                self._checked_t = now
                if current is not None and int(current.get("session", 0)) > self.session:
                    held = read_heartbeat(self.store, self.learner_id) or HeldBy(current, 0.0)
                    self.taken_over_by = held
                    log.error("learner id %r was taken over by a newer session (%s); this session stops",
                              self.learner_id, describe(held))
                    return
            self.store.put(self.hb_key, heartbeat_bytes(self.make_record(), signer=self.signer))
        except Exception as exc:  # noqa: BLE001 - a missed heartbeat is not fatal
            log.warning("heartbeat failed: %s", exc)

    def write_state(self, *, force: bool = False) -> None:
        """Write the data state if it changed since the last write and that write is
        ``check_every_s`` old (``force``: whenever it changed)."""
        with self.lock:
            state = self._state
        if state is None or state == self._state_written or self.taken_over_by is not None:
            return
        now = self.clock()
        if not force and self._state_t is not None and now - self._state_t < self.check_every_s:
            return
        rec = records.make("learner_state", run_id=self.run_id, learner_id=self.learner_id, session=self.session,
                           data=state)
        data = records.dumps(rec)
        if len(data) > MAX_STATE_BYTES:
            log.warning("data state of %d bytes is over the %d-byte bound; not saved", len(data), MAX_STATE_BYTES)
        else:
            try:
                self.store.put(layout.learner_state_key(self.learner_id), data)
            except Exception as exc:  # noqa: BLE001 - the next send saves it again
                log.warning("saving the data state failed: %s", exc)
                return
        self._state_written, self._state_t = state, now

    def _raise_alert(self) -> None:
        with self.lock:
            alert, self._alert = self._alert, None
        if alert is not None:
            log.warning("%s; %s", alert, self._syncer_liveness())

    def _syncer_liveness(self) -> str:
        try:
            beats = ledger.read_heartbeats(self.store, layout.SYNCER_HEARTBEAT_PREFIX, "syncer_heartbeat")
        except Exception as exc:  # noqa: BLE001 - the alert still goes out
            return f"the syncer heartbeats could not be read ({exc})"
        live = [b for b in beats if b.record["state"] == "serving" and b.age_s <= self.lease_s]
        if not live:
            return "no syncer heartbeat is live: start one with `ddiloco sync URL`"
        b = live[-1]
        return (f"a syncer heartbeat is live ({b.record['syncer_id'] or 'epoch ' + str(b.record['epoch'])}, "
                f"{b.age_s:.1f}s old): it may be waiting for a quorum or failing to commit")

    def run(self) -> None:
        while not self.stopping.is_set():
            wait_s = self.tick()
            self.wakeup.wait(wait_s)
            self.wakeup.clear()

    def tick(self) -> float:
        """Log a pending alert; write the data state and the heartbeat when a beat is due.
        Returns seconds until the next beat (``run`` waits that long; a driver without
        threads, the deterministic simulation, calls ``tick`` again then)."""
        self._raise_alert()
        now = self.clock()
        if now >= self._next_beat:
            self.write_state()
            self.beat()
            self._next_beat = now + self.every_s
        return max(0.0, self._next_beat - self.clock())

    def close(self, *, final_beat: bool = True) -> None:
        self.stopping.set()
        self.wakeup.set()
        if self.is_alive():
            self.join(timeout=10)
        self.write_state(force=True)
        if final_beat:
            self.beat(check=True)  # the last word: never over a newer session's heartbeat


def running_phases(store: Store, *, learner_id: str, config: Any, trust: signing.Trust) -> list[float] | None:
    """The send-schedule phases (step + offset, aged to now by their step time) of the other
    running learners, from their heartbeats (``schedule.aligned_offset`` puts a starting
    learner in phase with them). Advisory: an unreadable or foreign heartbeat is skipped;
    None when the heartbeats cannot be read at all."""
    try:
        beats = ledger.read_heartbeats(store, layout.LEARNER_HEARTBEAT_PREFIX, "learner_heartbeat")
    except (DdilocoError, OSError) as exc:  # the store failed past its retries: start unshifted
        log.warning("schedule offset 0: the learners' heartbeats cannot be read (%s)", exc)
        return None
    H, phases = config.sync_every, []
    for b in beats:
        rec = b.record
        step_s, offset = rec.get("step_time_s") or 0.0, rec.get("schedule_offset", 0)
        if (rec["learner_id"] == learner_id or rec["state"] != "running" or b.age_s > config.lease_s
                or step_s <= 0 or not isinstance(offset, int) or not 0 <= offset < H
                or not trust.admits(rec, key=b.key, role="learner", member_id=rec["learner_id"])):
            continue
        if b.age_s / step_s > H / 2:  # too many steps since it was written to tell its phase
            continue
        phases.append(rec["step"] + offset + b.age_s / step_s)
    return phases


def jsonable(data: Any) -> Any:
    """``data`` round-tripped through JSON: a clear error now rather than a failed
    write later when a task's state is not JSON-able."""
    try:
        return json.loads(json.dumps(data))
    except (TypeError, ValueError) as exc:
        raise UsageError(f"the data state {data!r:.80} is not JSON-able: {exc}") from exc
