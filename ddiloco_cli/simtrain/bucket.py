"""The simulated bucket: one in-memory object map, seen by each actor through a
``SimStore`` that charges every request's latency and transfer time to the actor's
``TurnClock``.

A write made during a turn becomes visible to the others only when it would have
finished (``visible_at`` = the actor's clock after the transfer); until then readers
see the object's previous content (or nothing). Reads see what was visible at the
moment of the request. A conditional create (``put_if_absent``) decides on what
exists, visible or not: the object store serialises creates of one key.

Costs per request: the link's round trip + the store's own latency + a seeded
uniform jitter, plus bytes / bandwidth. A view with ``parallel`` > 1 (the syncer's
intake keeps that many contribution downloads in flight) overlaps the latencies of
its contribution GETs: each costs its latency / parallel plus its transfer.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass

from ddiloco_cli.clock import VIRTUAL_EPOCH_S
from ddiloco_cli.protocol import layout
from ddiloco_cli.simtrain.loop import TurnClock
from ddiloco_cli.store import check_key
from ddiloco_cli.store.base import NotFound, ObjectInfo, ObjectTooLargeError

KEEP_VERSIONS = 4
# a heartbeat is charged as this many bytes: its exact size carries the host's name and pid,
# which would make the virtual times depend on the process that runs the simulation
HEARTBEAT_BYTES = 1024


def charged_bytes(key: str, data: bytes) -> int:
    if key.startswith(layout.SYNCER_HEARTBEAT_PREFIX) or key.endswith("/heartbeat.json"):
        return HEARTBEAT_BYTES
    return len(data)  # overwritten objects: the newest versions kept for readers that may not see the last one yet


def is_tensor_payload(key: str) -> bool:
    """A contribution, a published payload or a checkpoint (the objects of model tensors)."""
    return key.endswith(".safetensors")


def header_bytes(data: bytes) -> int:
    """The bytes of a tensor payload's safetensors header (its 8-byte length and JSON): a few
    hundred bytes per tensor whatever the tensor's size, so they do not grow with the model.
    0 where the length does not fit the data (not a payload: all of it scales)."""
    if len(data) < 8:
        return 0
    n = 8 + int.from_bytes(data[:8], "little")
    return n if n <= len(data) else 0


def scales_with_model(key: str) -> bool:
    """Whether the transfer time of ``key`` grows with the model (``SimBucket.payload_scale``):
    the tensor payloads. The run's
    first version is left out: the references' workers build it from the seed at no cost, and a
    real learner could too, so the start-up download is not charged at the larger size."""
    return is_tensor_payload(key) and f"/payloads/{layout.num(0)}-" not in key


@dataclass(frozen=True)
class Link:
    up_bps: float  # bytes per second
    down_bps: float
    latency_s: float  # per request: round trip + the store's own time
    jitter_s: float = 0.0

    @staticmethod
    def of(*, up_mbps: float, down_mbps: float, rtt_ms: float, jitter_ms: float, store_latency_ms: float) -> "Link":
        return Link(up_mbps * 1e6 / 8, down_mbps * 1e6 / 8, (rtt_ms + store_latency_ms) / 1e3, jitter_ms / 1e3)


class Wire:
    """One learner's link as its connections (training loop, upload workers, receiver) share it
    for tensor payloads: their transfers in one direction queue behind each other, first come
    first served; request latencies overlap. Records (heartbeats, manifests, LISTs) do not
    queue: a few kB take their share of a busy link within a round trip. The syncer's
    connections do not share one (its link is the datacenter's)."""

    def __init__(self) -> None:
        self.free_at = {"up": 0.0, "down": 0.0}  # virtual time each direction is free again


class SimBucket:
    """key -> versions [(visible_at, data)], oldest first."""

    def __init__(self) -> None:
        self.objects: dict[str, list[tuple[float, bytes]]] = {}
        self._keys: list[str] = []  # the keys of ``objects``, sorted: a LIST is a range of it, not a scan
        self.num_requests = 0
        self.last_contribution_t = 0.0  # when the newest contribution became visible
        self.last_write_t = 0.0  # when the last write lands
        self.crash = None  # a crash.CrashPlan: called before and after every write
        # transfer time of tensor payloads x this (Scenario.model_params: the times of a larger
        # model with the simulated one's loss per step); byte counters stay the real sizes
        self.payload_scale = 1.0

    def visible(self, key: str, t: float) -> tuple[float, bytes] | None:
        for version in reversed(self.objects.get(key, ())):
            if version[0] <= t:
                return version
        return None

    def write(self, key: str, data: bytes, visible_at: float) -> None:
        self.last_write_t = max(self.last_write_t, visible_at)
        if key.startswith(layout.CONTRIBUTION_ROOT):
            self.last_contribution_t = max(self.last_contribution_t, visible_at)
        versions = self.objects.get(key)
        if versions is None:
            versions = self.objects[key] = []
            bisect.insort(self._keys, key)
        versions.append((visible_at, data))
        versions.sort(key=lambda v: v[0])
        del versions[:-KEEP_VERSIONS]

    def remove(self, key: str) -> None:
        if self.objects.pop(key, None) is not None:
            del self._keys[bisect.bisect_left(self._keys, key)]

    def keys_with(self, prefix: str) -> list[str]:
        """The keys that start with ``prefix``, sorted."""
        keys = self._keys
        start = end = bisect.bisect_left(keys, prefix)
        while end < len(keys) and keys[end].startswith(prefix):
            end += 1
        return keys[start:end]

    def without(self, prefix: str) -> "SimBucket":
        """A copy of the objects whose keys do not start with ``prefix`` (nothing else carried over)."""
        out = SimBucket()
        for key in self._keys:
            if not key.startswith(prefix):
                out.objects[key] = list(self.objects[key])
                out._keys.append(key)
        return out

    def peek(self, key: str) -> bytes | None:
        """The newest content of ``key``, visible or not (the harness's own reads)."""
        versions = self.objects.get(key)
        return versions[-1][1] if versions else None


class SimStore:
    """One actor's connection to the ``SimBucket`` (a ddiloco ``Store``)."""

    # reads one at a time, in the caller's order: each charges virtual time and may draw jitter
    # from this connection's generator (published.FragmentReader reads distant buckets concurrently)
    concurrent_reads = False

    def __init__(self, bucket: SimBucket, clock: TurnClock, link: Link, *, name: str, seed: str,
                 parallel: int = 1, free: bool = False, wire: Wire | None = None):
        self.bucket, self.clock, self.link, self.wire = bucket, clock, link, wire
        self.url = f"sim://{name}"
        self.name = name
        self.in_commit = False  # the syncer's connection: inside Syncer.commit (crash points)
        self.parallel = parallel
        self.free = free  # the harness's own reads: no cost
        self._rng = random.Random(seed)
        self._charge_before_write = 0.0
        self.bytes_up = self.bytes_down = 0
        self.num_requests = 0
        self.contributions_listed_t = -1.0  # the start of the turn that last LISTed contributions

    # ------------------------------------------------------------ costs
    def _request(self, *, up: int = 0, down: int = 0, overlapped: bool = False, scale: float = 1.0,
                 fixed: int = 0, payload: bool = False) -> None:
        """Charge one request: its latency, and its bytes over the link, of which all but
        ``fixed`` (a payload's header) take ``scale`` times as long."""
        if self.free:
            return
        self.num_requests += 1
        self.bucket.num_requests += 1
        latency = self.link.latency_s
        if self.link.jitter_s > 0:
            latency += self._rng.random() * self.link.jitter_s
        if overlapped:
            latency /= self.parallel
        transfer = (fixed + scale * (up + down - fixed)) / (self.link.up_bps if up else self.link.down_bps)
        wire = self.wire if payload and transfer > 0 else None
        wait, direction = 0.0, "up" if up else "down"
        if wire is not None:  # behind the payloads already on the shared link
            wait = max(0.0, wire.free_at[direction] - (self.clock.monotonic() + latency))
        self.clock.spent += latency + wait + transfer
        if wire is not None:
            wire.free_at[direction] = self.clock.monotonic()
        self.bytes_up += up
        self.bytes_down += down

    def _payload(self, key: str, data: bytes) -> dict:
        """A request's keywords for ``key`` holding ``data``: its transfer-time scale (the
        header at 1: a larger model's payload has a header of about this size, and its
        tensor data ``payload_scale`` times as many bytes), and whether it is a tensor
        payload (which queues on a shared link)."""
        if not scales_with_model(key) or self.bucket.payload_scale == 1.0:
            return dict(payload=is_tensor_payload(key))
        return dict(scale=self.bucket.payload_scale, fixed=header_bytes(data), payload=True)

    def charge_before_next_write(self, seconds: float) -> None:
        """Compute time that precedes this turn's next write (the syncer's merge: its cost
        is known before, its result is written after)."""
        self._charge_before_write = seconds

    def _pay_pending(self) -> None:
        if self._charge_before_write:
            self.clock.spent += self._charge_before_write
            self._charge_before_write = 0.0

    # ------------------------------------------------------------ Store
    def _crash_point(self, key: str, phase: str) -> None:
        if self.bucket.crash is not None:
            self.bucket.crash.on_write(self, key, phase)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        check_key(key)
        self._crash_point(key, "before")
        self._pay_pending()
        data = bytes(data)
        existing = self.bucket.peek(key)
        self._request(up=charged_bytes(key, data), **self._payload(key, data))
        if existing is not None:
            return existing == data
        self.bucket.write(key, data, self.clock.monotonic())
        self._crash_point(key, "after")
        return True

    def put(self, key: str, data: bytes) -> None:
        check_key(key)
        self._crash_point(key, "before")
        self._pay_pending()
        self._request(up=charged_bytes(key, data), **self._payload(key, data))
        self.bucket.write(key, bytes(data), self.clock.monotonic())
        self._crash_point(key, "after")

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        check_key(key)
        found = self.bucket.visible(key, self.clock.monotonic())
        if found is None:
            self._request()
            raise NotFound(key)
        data = found[1]
        if max_bytes is not None and len(data) > max_bytes:
            self._request()
            raise ObjectTooLargeError(key, size=len(data), max_bytes=max_bytes)
        self._request(down=charged_bytes(key, data), **self._payload(key, data),
                      overlapped=self.parallel > 1 and key.startswith(layout.CONTRIBUTION_ROOT))
        return data

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        t = self.clock.monotonic()
        if prefix.startswith(layout.CONTRIBUTION_ROOT):
            # the turn's start, not t: a write visible before t may still be made by an event after it
            self.contributions_listed_t = self.clock.loop.now
        out = []
        for key in self.bucket.keys_with(prefix):
            found = self.bucket.visible(key, t)
            if found is not None:
                out.append(ObjectInfo(key=key, size=len(found[1]), mtime_s=VIRTUAL_EPOCH_S + found[0]))
        self._request(down=64 * len(out))
        return out

    def delete(self, key: str) -> None:
        check_key(key)
        self._request()
        self.bucket.remove(key)

    def remove_stale_temp(self, *, older_than_s: float, dry_run: bool = False) -> list[ObjectInfo]:
        return []

    def now(self) -> float:
        return self.clock.time()
