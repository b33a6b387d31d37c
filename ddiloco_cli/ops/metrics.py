"""Metrics history: compact records in rolling segments in the bucket, and their readers.

Learners and syncers append one flat record per log step (loss, tokens/s, step time,
blocked time, bytes, versions behind, merges, quorum sizes, grace, quarantines, global
val loss, ...) to ``metrics/<role>/<writer id>/<segment>.jsonl`` (PROTOCOL.md, "Metrics
history"). These objects are non-authoritative: nothing in training reads them.

* ``MetricsWriter.log`` only appends to an in-memory buffer; a background thread
  serialises and uploads every ``flush_every_s``, so the training loop never waits on
  the bucket. A segment holds at most ``records_per_segment`` lines and
  ``segment_bytes`` bytes; a writer keeps at most ``max_segments`` segments (its
  restarts included), deleting the oldest, so a writer's history is bounded. Keys
  carry a per-process nonce: a process only ever overwrites its own segments.
* ``read_metrics`` treats every segment as untrusted input: bounded object size,
  bounded line length, flat records of finite numbers and short strings only. Bad
  objects and lines are skipped with a one-line warning naming the key.
* ``MetricsLogger`` is the small interface behind ``--log-with`` (TensorBoard, W&B,
  MLflow, all offline-capable optional extras) and ``ddiloco metrics --tensorboard``.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ddiloco_cli.errors import ProtocolError
from ddiloco_cli.ops.metric_loggers import (
    LOGGERS,
    MetricsLogger,
    MlflowLogger,
    TensorBoardLogger,
    WandbLogger,
    make_logger,
)
from ddiloco_cli.ops.metrics_files import check_output_path, make_parent, write_csv, write_tensorboard
from ddiloco_cli.protocol import layout, ledger, records
from ddiloco_cli.store.base import NotFound, ObjectInfo, ObjectTooLargeError, Store

log = logging.getLogger(__name__)

# reader bounds: a hostile bucket cannot make a reader allocate or parse without limit
MAX_SEGMENT_BYTES = 1 << 20
MAX_LINE_CHARS = 4096
MAX_FIELDS = 64
MAX_STR_CHARS = 128
MAX_SEGMENTS_READ = 256  # newest segments per writer
MAX_WRITERS_READ = 4096
_FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]{0,63}$")


def writer_id_from(text: str) -> str:
    """A valid metrics writer id made from free text (host names, fragment specs): every
    character the id grammar refuses becomes '-'."""
    cleaned = "".join(c if layout.valid_learner_id("a" + c) else "-" for c in text).strip("-._")[:64]
    return cleaned if layout.valid_learner_id(cleaned) else "writer"


# ---------------------------------------------------------------------- writer
class MetricsWriter:
    """Buffered, rolling writer of one process's metrics records.

    ``log(step=..., **fields)`` is cheap (a dict append under a lock) and never touches
    the bucket. ``start()`` runs the flusher thread; ``close()`` flushes what is left and
    closes the external loggers. Upload failures are logged and retried at the next
    flush; at most ``max_segments`` finished-but-unwritten segments are kept in memory.
    Times (``t``) are on the store's clock, offset once at the first flush, so records
    of machines with skewed clocks line up.
    """

    def __init__(self, store: Store, *, role: str, writer_id: str, flush_every_s: float = 10.0,
                 records_per_segment: int = 2000, segment_bytes: int = 256 * 1024, max_segments: int = 16,
                 loggers: Iterable["MetricsLogger"] = ()):
        if role not in layout.METRICS_ROLES:
            raise ValueError(f"metrics role must be one of {layout.METRICS_ROLES}, not {role!r}")
        if not layout.valid_learner_id(writer_id):
            raise ValueError(f"metrics writer id {writer_id!r} is not a valid id (see writer_id_from)")
        if segment_bytes > MAX_SEGMENT_BYTES or records_per_segment < 1 or max_segments < 1:
            raise ValueError("segment_bytes must be <= MAX_SEGMENT_BYTES; records_per_segment and max_segments >= 1")
        self.store, self.role, self.writer_id = store, role, writer_id
        self.flush_every_s = flush_every_s
        self.records_per_segment, self.segment_bytes, self.max_segments = records_per_segment, segment_bytes, max_segments
        self.loggers = list(loggers)
        self._lock = threading.Lock()
        self._pending: list[dict[str, Any]] = []
        self._first = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._clock_offset_s: float | None = None
        # segment state, touched only by the flushing thread (or close after it stopped)
        self._segments: deque[tuple[int, str]] | None = None  # (number, key) of this id's segments, oldest first
        self._segment: int | None = None  # the segment being filled
        self.nonce = uuid.uuid4().hex[:8]  # in every key it writes: it never overwrites another process's
        self._lines: list[bytes] = []
        self._lines_bytes = 0
        self._unwritten: dict[int, bytes] = {}  # finished segments whose upload failed

    def log(self, *, step: int, **fields: Any) -> None:
        """Buffer one record. Fields are scalars (numbers, short strings); None is dropped.
        The first record of a process is marked ``event="start"`` (a restart in a plot)."""
        record = {k: v for k, v in fields.items() if v is not None}
        record["step"] = int(step)
        record["t"] = time.time()
        with self._lock:
            if self._first:
                record.setdefault("event", "start")
                self._first = False
            self._pending.append(record)

    def start(self) -> "MetricsWriter":
        self._thread = threading.Thread(target=self._run, name=f"ddiloco-metrics-{self.role}", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.flush()
        for logger in self.loggers:
            try:
                logger.close()
            except Exception as exc:  # noqa: BLE001 - a broken external logger must not fail training
                log.warning("metrics: closing %s failed: %s", type(logger).__name__, exc)

    def _run(self) -> None:
        while not self._stop.wait(self.flush_every_s):
            self.flush()

    def flush(self) -> None:
        """Upload the buffered records now (called by the flusher thread and close)."""
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending and not self._unwritten:
            return
        try:
            if self._clock_offset_s is None:
                self._clock_offset_s = self.store.now() - time.time()
            if self._segments is None:  # continue after the segments of this id's earlier sessions
                infos = self.store.list(layout.metrics_prefix(self.role, self.writer_id))
                self._segments = deque(sorted((parsed[2], i.key) for i in infos
                                              if (parsed := layout.parse_metrics_key(i.key)) is not None))
        except Exception as exc:  # noqa: BLE001 - metrics are best effort; retried next flush
            log.warning("metrics: cannot reach %s (%s); will retry", self.store.url, exc)
            with self._lock:
                self._pending[:0] = pending
            return
        for record in pending:
            # compact lines: 6 significant digits are plenty for a curve; t to the millisecond
            record = {k: float(f"{v:.6g}") if isinstance(v, float) and k != "t" else v for k, v in record.items()}
            record["t"] = round(record["t"] + self._clock_offset_s, 3)
            self._forward(record)
            line = (json.dumps(record, separators=(",", ":"), allow_nan=False, default=str) + "\n").encode()
            if len(line) > MAX_LINE_CHARS:
                log.warning("metrics: record of %d bytes dropped (limit %d)", len(line), MAX_LINE_CHARS)
                continue
            if self._segment is not None and (len(self._lines) >= self.records_per_segment
                                              or self._lines_bytes + len(line) > self.segment_bytes):
                self._unwritten[self._segment] = b"".join(self._lines)
                self._segment, self._lines, self._lines_bytes = None, [], 0
            if self._segment is None:
                self._segment = (self._segments[-1][0] + 1) if self._segments else 0
                self._segments.append((self._segment, self._key(self._segment)))
            self._lines.append(line)
            self._lines_bytes += len(line)
        if self._segment is not None and self._lines:
            self._unwritten[self._segment] = b"".join(self._lines)  # rewritten until it is full
        self._upload()

    def _upload(self) -> None:
        for seg in sorted(self._unwritten):
            try:
                self.store.put(self._key(seg), self._unwritten[seg])
                del self._unwritten[seg]
            except Exception as exc:  # noqa: BLE001 - retried at the next flush
                log.warning("metrics: upload of segment %d failed (%s); will retry", seg, exc)
        while len(self._unwritten) > self.max_segments:
            del self._unwritten[min(self._unwritten)]
        while len(self._segments) > self.max_segments:
            _, key = self._segments.popleft()
            try:
                self.store.delete(key)
            except Exception as exc:  # noqa: BLE001 - an undeleted segment only costs bytes
                log.warning("metrics: deleting old segment %s failed (%s)", key, exc)

    def _key(self, segment: int) -> str:
        return layout.metrics_segment_key(self.role, self.writer_id, segment, self.nonce)

    def _forward(self, record: dict[str, Any]) -> None:
        for logger in self.loggers:
            try:
                logger.log(record, role=self.role, writer_id=self.writer_id)
            except Exception as exc:  # noqa: BLE001 - an external logger must not fail training
                log.warning("metrics: %s failed: %s", type(logger).__name__, exc)


# ------------------------------------------------ progress hooks (learn / sync)
def _version_stats(versions: dict) -> dict[str, int]:
    vs = [int(v) for v in versions.values()]
    return {"version_min": min(vs), "version_max": max(vs), "version_sum": sum(vs), "version_count": len(vs)} if vs else {}


def learner_progress_hook(writer: MetricsWriter, *, every_steps: int = 10) -> Callable[[dict[str, Any]], None]:
    """An ``on_progress`` callback for ``Learner`` that logs one record every
    ``every_steps`` steps: loss, lr, step time, tokens/s since the last record,
    blocked time, bytes, ddiloco's share of a step (its heartbeat's cost report) and the
    fragment versions it holds."""
    last: dict[str, float] = {}

    def hook(p: dict[str, Any]) -> None:
        if p["step"] % every_steps:
            return
        now = time.monotonic()
        tokens_per_s = ((p["tokens"] - last["tokens"]) / (now - last["t"])
                        if last and now > last["t"] else None)
        last.update(t=now, tokens=p["tokens"])
        writer.log(step=p["step"], loss=p.get("loss"), lr=p.get("lr"), step_time_s=p.get("step_time_s"),
                   tokens=p["tokens"], tokens_per_s=tokens_per_s, blocked_s=p.get("blocked_s"),
                   bytes_up=p.get("bytes_up"), bytes_down=p.get("bytes_down"),
                   versions_behind=p.get("versions_behind"), ddiloco_share=p.get("ddiloco_share"),
                   **_version_stats(p.get("versions") or {}))

    return hook


def syncer_progress_hook(writer: MetricsWriter, *, every_s: float = 10.0,
                         on_merges: Callable[[int], None] | None = None) -> Callable[[dict[str, Any]], None]:
    """An ``on_progress`` callback for ``Syncer`` that logs a record when merges happened
    (at most one per second) or every ``every_s``: merges, quorum sizes, grace,
    pending and quarantined contributions, live learners, bytes, versions.
    ``on_merges(num_merges)`` is called on every new merge count (periodic evaluation)."""
    last = {"t": float("-inf"), "merges": -1}

    def hook(p: dict[str, Any]) -> None:
        now = time.monotonic()
        merges = int(p["num_merges"])
        if on_merges is not None and merges != last["merges"]:
            on_merges(merges)
        if not (merges != last["merges"] and now - last["t"] >= 1.0 or now - last["t"] >= every_s):
            return
        last.update(t=now, merges=merges)
        quorum = [q for q in (p.get("quorum_sizes") or {}).values() if q]
        writer.log(step=merges, merges=merges, epoch=p.get("epoch"), quarantined=p.get("num_quarantined"),
                   pending=sum((p.get("pending") or {}).values()), live_learners=p.get("live_learners"),
                   quorum_min=min(quorum, default=None), quorum_max=max(quorum, default=None),
                   grace_s=p.get("grace_s"), bytes_in=p.get("bytes_in"), bytes_out=p.get("bytes_out"),
                   suspect_learners=p.get("suspect_learners"),
                   ledger_repairs=p.get("num_repairs"),  # manifests put back or junk deleted (repair.py)  # cut by a bound or refused 3 times in a row
                   **_version_stats(p.get("versions") or {}))

    return hook


def open_writer(store: Store, *, role: str, writer_id: str, log_with: Iterable[str] = (),
                log_dir: str = "ddiloco-logs") -> MetricsWriter:
    """A started MetricsWriter for this process, forwarding to the ``--log-with`` loggers."""
    names = list(log_with)
    run_id = ledger.read_run(store)["run_id"] if names else ""
    loggers = [make_logger(n, run_id=run_id, role=role, writer_id=writer_id, log_dir=log_dir) for n in names]
    return MetricsWriter(store, role=role, writer_id=writer_id, loggers=loggers).start()


def chain(*hooks: Callable[[dict[str, Any]], None] | None) -> Callable[[dict[str, Any]], None] | None:
    """One ``on_progress`` callback calling every given one (None entries skipped)."""
    live = [h for h in hooks if h is not None]
    if len(live) <= 1:
        return live[0] if live else None

    def each(progress: dict[str, Any]) -> None:
        for hook in live:
            hook(progress)

    return each


def add_versions_behind(records: list["Record"]) -> None:
    """Fill ``versions_behind`` of learner records that lack it: the syncers' summed
    committed versions (each syncer's newest record at or before the learner's) minus
    the learner's summed held versions, per fragment: how many versions a fragment the
    learner holds is behind the global model, on average."""
    syncer_points = sorted((r.t, r.writer_id, r.fields["version_sum"])
                           for r in records if r.role == "syncer" and "version_sum" in r.fields)
    learners = sorted((r for r in records if r.role == "learner" and "version_sum" in r.fields
                       and "versions_behind" not in r.fields), key=lambda r: r.t)
    latest: dict[str, float] = {}
    i = 0
    for r in learners:
        while i < len(syncer_points) and syncer_points[i][0] <= r.t:
            latest[syncer_points[i][1]] = syncer_points[i][2]
            i += 1
        if latest:
            behind = max(sum(latest.values()) - r.fields["version_sum"], 0)
            r.fields["versions_behind"] = round(behind / max(int(r.fields.get("version_count", 1)), 1), 3)


# ---------------------------------------------------------------------- reader
@dataclass(frozen=True)
class Record:
    role: str
    writer_id: str
    fields: dict[str, Any]  # always has "t" (store clock, s) and "step"

    @property
    def t(self) -> float:
        return float(self.fields["t"])

    @property
    def step(self) -> int:
        return int(self.fields["step"])


def parse_line(line: bytes) -> dict[str, Any] | None:
    """A flat record from one untrusted line, or None when it is not one: a JSON object
    of at most MAX_FIELDS fields named like identifiers, whose values are finite numbers
    or strings of at most MAX_STR_CHARS, with numeric ``t`` and integer ``step``."""
    try:
        obj = records.parse_json(line, where="metrics line", max_bytes=MAX_LINE_CHARS)
    except ProtocolError:
        return None
    if not isinstance(obj, dict) or len(obj) > MAX_FIELDS:
        return None
    for key, value in obj.items():
        if not _FIELD.match(key):
            return None
        if isinstance(value, bool) or value is None:
            return None
        if isinstance(value, (int, float)):
            if not math.isfinite(value):
                return None
        elif not (isinstance(value, str) and len(value) <= MAX_STR_CHARS):
            return None
    if not isinstance(obj.get("t"), (int, float)) or not isinstance(obj.get("step"), int):
        return None
    return obj


def read_metrics(store: Store, *, role: str | None = None) -> list[Record]:
    """Every readable record in the bucket's metrics history, ordered by (role, writer,
    segment, line). Oversized objects, unreadable segments and bad lines are skipped with
    one warning per segment; at most MAX_SEGMENTS_READ newest segments per writer and
    MAX_WRITERS_READ writers are read."""
    prefix = f"{layout.METRICS_PREFIX}{role}/" if role else layout.METRICS_PREFIX
    by_writer: dict[tuple[str, str], list[tuple[int, str, int]]] = {}
    for info in store.list(prefix):
        parsed = layout.parse_metrics_key(info.key)
        if parsed is None:
            log.warning("metrics: %s is not a metrics segment name; skipped", info.key)
            continue
        by_writer.setdefault(parsed[:2], []).append((parsed[2], info.key, info.size))
    if len(by_writer) > MAX_WRITERS_READ:
        log.warning("metrics: %d writers, reading the first %d", len(by_writer), MAX_WRITERS_READ)
    out: list[Record] = []
    for (r, wid) in sorted(by_writer)[:MAX_WRITERS_READ]:
        for _, key, size in sorted(by_writer[(r, wid)])[-MAX_SEGMENTS_READ:]:
            out.extend(Record(r, wid, fields) for fields in _read_segment(store, key, size))
    return out


def _read_segment(store: Store, key: str, size: int) -> list[dict[str, Any]]:
    if size > MAX_SEGMENT_BYTES:
        log.warning("metrics: %s is %d bytes (limit %d); skipped", key, size, MAX_SEGMENT_BYTES)
        return []
    try:
        data = store.get(key, max_bytes=MAX_SEGMENT_BYTES)
    except NotFound:
        return []  # rolled away since the LIST
    except ObjectTooLargeError as exc:  # grew since the LIST
        log.warning("metrics: %s; skipped", exc)
        return []
    records, bad = [], []
    for n, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        rec = parse_line(line)
        if rec is None:
            bad.append(n)
        else:
            records.append(rec)
    if bad:
        log.warning("metrics: %s: %d malformed line(s) skipped (first: line %d)", key, len(bad), bad[0])
    return records


def latest_global_eval(store: Store, *, infos: Iterable[ObjectInfo]) -> dict[str, Any] | None:
    """The newest ``global_val_loss`` record of any syncer ({val_loss, t, step}), from the
    newest segment of each syncer writer among ``infos`` (a LIST the caller already made:
    ``ddiloco status`` reads one segment per syncer, not the history). None if none."""
    newest: dict[str, tuple[int, ObjectInfo]] = {}
    for info in infos:
        parsed = layout.parse_metrics_key(info.key)
        if parsed is not None and parsed[0] == "syncer" and (parsed[1] not in newest
                                                             or parsed[2] >= newest[parsed[1]][0]):
            newest[parsed[1]] = (parsed[2], info)
    found = [rec for _, info in newest.values() for rec in _read_segment(store, info.key, info.size)
             if "global_val_loss" in rec]
    best = max(found, key=lambda rec: rec["t"], default=None)
    return None if best is None else {"val_loss": best["global_val_loss"], "t": best["t"], "step": best["step"]}


__all__ = ["MetricsWriter", "latest_global_eval", "open_writer", "learner_progress_hook", "syncer_progress_hook", "chain", "add_versions_behind", "Record", "read_metrics", "parse_line", "write_csv", "write_tensorboard", "check_output_path", "make_parent",
           "MetricsLogger", "TensorBoardLogger", "WandbLogger", "MlflowLogger", "make_logger", "writer_id_from", "LOGGERS"]
