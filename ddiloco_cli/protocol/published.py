"""Global fragment versions: encoding their payloads and reading them back.

A committed version of fragment p names one or two payloads in its manifest:

* ``full``: the exact published fp32 value (codec "none"), a keyframe. Version 0
  carries one, and with ``publish_codec = none`` every version does; otherwise the
  run's ``keyframe_rule`` says which (``keyframe_due``): ``every``, each
  ``keyframe_every``-th version; ``size``, the version after the deltas since the
  last keyframe have grown as large as it, or ``keyframe_every`` versions after it.
* ``delta``: the published value minus the previous version's, quantized with
  ``publish_codec``. The syncer keeps the *published* value as the truth (so the
  quantization error is carried into the next delta): every reader that applies
  the same deltas to the same keyframe gets a bit-identical value.

Readers check each payload's size and sha256 against the manifest before
decoding and the decoded shapes against the fragment plan.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ddiloco_cli.errors import InvalidPayloadError, ProtocolError
from ddiloco_cli.numerics import codec
from ddiloco_cli.protocol import layout, ledger, records
from ddiloco_cli.protocol.fragments import FragmentPlan, assemble_parameters
from ddiloco_cli.protocol.signing import Trust
from ddiloco_cli.store.base import NotFound, Store

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class KeyframeChain:
    """A fragment's newest keyframe and the published deltas after it: what the size rule
    reads (``keyframe_due``)."""

    keyframe: int  # the version of the newest keyframe
    keyframe_bytes: int  # its full payload's size
    delta_bytes: int = 0  # the delta payloads of the versions after it, summed

    def after(self, version: int, sizes: dict[str, int]) -> "KeyframeChain":
        """The chain once ``version`` is committed with payloads of ``sizes`` ({kind: bytes},
        ``payload_sizes``)."""
        if "full" in sizes:
            return KeyframeChain(version, sizes["full"])
        return KeyframeChain(self.keyframe, self.keyframe_bytes, self.delta_bytes + sizes.get("delta", 0))


def payload_sizes(entries: list[dict[str, Any]]) -> dict[str, int]:
    """{kind: size} of a manifest's payload entries (or ``EncodedVersion.payloads``' entries)."""
    return {e["kind"]: int(e["size"]) for e in entries}


def keyframe_chain(manifest: Callable[[int], dict[str, Any]], version: int) -> KeyframeChain:
    """The chain ending at committed ``version``, from its manifests (``manifest(v)``, newest
    first down to the newest full payload). ProtocolError when no version at or below it has one."""
    deltas = 0
    for v in range(version, -1, -1):
        m = manifest(v)
        full = _payload_size(m, "full")
        if full is not None:
            return KeyframeChain(v, full, deltas)
        deltas += _payload_size(m, "delta") or 0
    raise ProtocolError(f"fragment {manifest(version)['fragment']}: no keyframe at or below version {version}")


def keyframe_due(version: int, *, publish_codec: str, keyframe_every: int, rule: str,
                 chain: KeyframeChain | None) -> bool:
    """Whether ``version`` carries a full payload (a keyframe) besides its delta. Rule ``every``:
    each ``keyframe_every``-th version. Rule ``size`` (``chain``: the versions before it):
    when the deltas since the last keyframe add up to at least its size (a reader starting
    there would read more than a new keyframe), or ``keyframe_every`` versions after it."""
    if publish_codec == "none" or version == 0:
        return True
    if rule == "size":
        assert chain is not None and chain.keyframe < version
        return version - chain.keyframe >= keyframe_every or chain.delta_bytes >= chain.keyframe_bytes
    return version % keyframe_every == 0


@dataclass
class EncodedVersion:
    """Payload bytes of a new version, ready to upload before its manifest."""

    published: Tensors  # the exact value readers will reconstruct
    payloads: list[tuple[str, bytes, dict[str, Any]]]  # (key, data, manifest entry)


def encode_version(
    *,
    fragment: int,
    version: int,
    new_value: Tensors,
    prev_published: Tensors | None,
    publish_codec: str,
    block_size: int,
    keyframe: bool,
    qmax: int | None = None,
    density: float | None = None,
) -> EncodedVersion:
    """Encode ``new_value`` as version ``version``: a delta from ``prev_published``
    (quantized, error fed back) and/or a full keyframe (``keyframe``; always at version 0
    and with ``publish_codec = none``)."""
    nonce = records.new_nonce()[:12]
    payloads = []
    published = new_value
    if publish_codec != "none" and version > 0:
        assert prev_published is not None
        data, published = codec.encode_published_delta(
            prev_published, new_value, codec=publish_codec, block_size=block_size, qmax=qmax, density=density
        )
        key = layout.payload_key(fragment, version, "delta", nonce)
        payloads.append((key, data, {"key": key, "kind": "delta", "base_version": version - 1, "codec": publish_codec}))
    if publish_codec == "none" or version == 0 or keyframe:
        data = codec.encode_tensors(published, codec="none")
        key = layout.payload_key(fragment, version, "full", nonce)
        payloads.append((key, data, {"key": key, "kind": "full", "base_version": None, "codec": "none"}))
    for _, data, entry in payloads:
        entry["size"] = len(data)
        entry["sha256"] = records.sha256_hex(data)
    return EncodedVersion(published, payloads)


def upload_payloads(store: Store, encoded: EncodedVersion) -> int:
    """Create every payload (unique names, so a conflict means our own retry). Returns bytes sent."""
    sent = 0
    for key, data, _ in encoded.payloads:
        if not store.put_if_absent(key, data):
            raise ProtocolError(f"payload name collision at {store.url}/{key}")
        sent += len(data)
    return sent


def expected_shapes(plan: FragmentPlan, fragment: int) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor (or row slice) of a fragment, keyed like gather_fragment."""
    return {
        s.key: ((s.row_end - s.row_start, *s.shape[1:]) if s.shape else ())
        for s in plan.fragments[fragment]
    }


def _payload_size(manifest: dict[str, Any], kind: str) -> int | None:
    return next((e["size"] for e in manifest["payloads"] if e["kind"] == kind), None)


def _cheapest_start(ms: list[dict[str, Any]]) -> int | None:
    """Where to start reading versions ms[0..]: -1 = from the value the reader has, then
    every delta; i = from the full payload of ms[i], then the deltas after it. Picks the
    fewer bytes (a long delta chain can cost more than one keyframe); None if neither works."""
    best: tuple[int, int] | None = None
    deltas = [_payload_size(m, "delta") for m in ms]
    if all(d is not None for d in deltas):
        best = (sum(deltas), -1)  # type: ignore[arg-type]
    for i in range(len(ms) - 1, -1, -1):
        full = _payload_size(ms[i], "full")
        if full is not None:
            if all(d is not None for d in deltas[i + 1:]):
                cost = full + sum(deltas[i + 1:])  # type: ignore[arg-type]
                if best is None or cost < best[0]:
                    best = (cost, i)
            break
    return None if best is None else best[1]


COLD_BATCH = 8  # manifests a cold read fetches at once, walking back to a keyframe


def reads_concurrently(store: Store) -> bool:
    """Whether reads of ``store`` may be made several at a time: a store may ask for them one at
    a time, in order (``concurrent_reads = False``: the simulation's, whose reads take virtual time)."""
    return bool(getattr(store, "concurrent_reads", True))


MANIFESTS_CACHED = 64  # a reader's cache of recent manifests


def _fetch_all(calls: list[Callable[[], Any]], *, concurrent: bool = True) -> list[Any]:
    """The results of ``calls`` (each a bucket read), made concurrently when there are several:
    on a distant bucket a cold read then costs a round trip per batch, not per object. An
    exception is returned in place of its result, for the caller to raise in order."""
    if len(calls) < 2 or not concurrent:
        out: list[Any] = []
        for call in calls:
            try:
                out.append(call())
            except Exception as exc:  # noqa: BLE001 (returned to the caller, which raises it)
                out.append(exc)
        return out
    with ThreadPoolExecutor(max_workers=min(len(calls), COLD_BATCH), thread_name_prefix="ddiloco-read") as pool:
        futures = [pool.submit(call) for call in calls]
    return [f.exception() or f.result() for f in futures]


class FragmentReader:
    """Reads published values of one fragment. Not thread-safe; one per thread (a cold read
    fetches its objects on a few short-lived threads of its own)."""

    def __init__(self, store: Store, *, run_id: str, plan: FragmentPlan, fragment: int, trust: Trust | None = None):
        self.store = store
        self.run_id = run_id
        self.trust = trust  # checks manifest signatures in runs that require them
        self.fragment = fragment
        self.expected = expected_shapes(plan, fragment)
        self.numel = plan.fragment_numel(fragment)
        self.bytes_down = 0
        self._manifests: dict[int, dict[str, Any]] = {}
        self.concurrent = reads_concurrently(store)

    def manifest(self, version: int) -> dict[str, Any]:
        """A committed manifest (immutable, so cached: a few recent ones)."""
        cached = self._manifests.get(version)
        if cached is None:
            cached = ledger.read_manifest(self.store, self.fragment, version, run_id=self.run_id, trust=self.trust)
            self._cache(version, cached)
        return cached

    def _cache(self, version: int, manifest: dict[str, Any]) -> None:
        self._manifests[version] = manifest
        while len(self._manifests) > MANIFESTS_CACHED:
            del self._manifests[min(self._manifests)]

    def prefetch(self, versions: range) -> None:
        """Read the manifests of ``versions`` not cached yet, concurrently. One that cannot be
        read is left out: the walk reads it again and raises its error in order."""
        if not self.concurrent:
            return
        todo = [v for v in versions if v >= 0 and v not in self._manifests]
        got = _fetch_all([lambda v=v: ledger.read_manifest(self.store, self.fragment, v, run_id=self.run_id,
                                                          trust=self.trust) for v in todo])
        for v, m in zip(todo, got):
            if not isinstance(m, BaseException):
                self._cache(v, m)

    def _payload(self, entry: dict[str, Any], *, version: int, data: bytes | BaseException | None = None) -> bytes:
        """The payload ``entry`` names, checked against it (``data``: its bytes, or the error, as
        a concurrent fetch got them)."""
        key = entry["key"]
        where = f"{self.store.url}/{key}"
        try:
            if data is None:
                data = self.store.get(key)
            elif isinstance(data, BaseException):
                raise data
        except NotFound:
            raise InvalidPayloadError(f"{where}: payload of version {version} is missing") from None
        self.bytes_down += len(data)
        if len(data) != entry["size"]:
            raise InvalidPayloadError(f"{where}: size {len(data)} != {entry['size']} recorded in the manifest")
        if records.sha256_hex(data) != entry["sha256"]:
            raise InvalidPayloadError(f"{where}: sha256 does not match the manifest")
        return data

    def _full(self, manifest: dict[str, Any]) -> Tensors | None:
        for entry in manifest["payloads"]:
            if entry["kind"] == "full":
                data = self._payload(entry, version=manifest["version"])
                where = f"{self.store.url}/{entry['key']}"
                values, _ = codec.decode_tensors(data, expected=self.expected, max_numel=self.numel, where=where)
                return values
        return None

    def _apply_delta(self, value: Tensors, manifest: dict[str, Any], *,
                     data: bytes | BaseException | None = None) -> Tensors | None:
        entry = self._delta_entry(manifest)
        if entry is None:
            return None
        data = self._payload(entry, version=manifest["version"], data=data)
        return codec.apply_published_delta(value, data, where=f"{self.store.url}/{entry['key']}")

    @staticmethod
    def _delta_entry(manifest: dict[str, Any]) -> dict[str, Any] | None:
        return next((e for e in manifest["payloads"]
                     if e["kind"] == "delta" and e.get("base_version") == manifest["version"] - 1), None)

    def _apply_deltas(self, value: Tensors, ms: list[dict[str, Any]]) -> Tensors:
        """``value`` with the deltas of ``ms`` (consecutive manifests) applied in order, their
        payloads fetched concurrently. ProtocolError when one has no delta payload."""
        entries = [self._delta_entry(m) for m in ms]
        got = _fetch_all([lambda e=e: self.store.get(e["key"]) for e in entries if e is not None],
                         concurrent=self.concurrent)
        datas = iter(got)
        for m, entry in zip(ms, entries):
            if entry is None:
                raise ProtocolError(f"{self.store.url}: version {m['version']} of fragment {self.fragment} has no delta payload")
            value = self._apply_delta(value, m, data=next(datas))
        return value

    def read(self, version: int, *, have: tuple[int, Tensors] | None = None) -> Tensors:
        """The published value at ``version``.

        ``have`` = (an older version, its published value) lets the reader apply
        the deltas in between instead of fetching a keyframe. Raises NotFound when
        a needed manifest is gone (garbage-collected), InvalidPayloadError or
        ProtocolError when bucket content is bad.
        """
        if have is not None and have[0] == version:
            return have[1]
        if have is not None and have[0] < version:
            try:
                # (no more than the cache holds: a reader far behind reads the rest one by one)
                self.prefetch(range(have[0] + 1, min(version, have[0] + MANIFESTS_CACHED) + 1))
                ms = [self.manifest(v) for v in range(have[0] + 1, version + 1)]
            except NotFound:
                log.info("fragment %d: versions after %d are gone; reading a keyframe", self.fragment, have[0])
            else:
                start = _cheapest_start(ms)
                if start is not None:
                    value = have[1] if start < 0 else self._full(ms[start])
                    return self._apply_deltas(value, ms[start + 1:])
        pending: list[dict[str, Any]] = []
        v = version
        while True:
            if v not in self._manifests:  # walking back to a keyframe: a batch of manifests at once
                self.prefetch(range(v, v - COLD_BATCH, -1))
            try:
                m = self.manifest(v)
            except NotFound:
                raise MissingVersionError(
                    f"{self.store.url}: version {v} of fragment {self.fragment} is missing (a gap in its ledger "
                    f"below version {version}), so that version cannot be read; the run's syncer puts back what "
                    f"it can prove, else `ddiloco status --check` alerts: run `ddiloco inspect {self.store.url} "
                    "--verify` and tell the run's operator") from None
            value = self._full(m)
            if value is not None:
                break
            pending.append(m)
            if v == 0:
                raise ProtocolError(f"{self.store.url}: fragment {self.fragment} has no keyframe at or below version {version}")
            v -= 1
        return self._apply_deltas(value, pending[::-1])


class MissingVersionError(ProtocolError, NotFound):
    """A manifest a read needs is gone: one line for the user (a ProtocolError), and still a
    NotFound for callers that fall back to an older checkpoint or a keyframe."""

    def __str__(self) -> str:
        return Exception.__str__(self)


def read_global_params(store: Store, *, run_id: str, plan: FragmentPlan,
                       trust: Trust | None = None) -> tuple[dict[str, torch.Tensor], dict[int, int]]:
    """The latest published value of every fragment, reassembled into whole fp32
    tensors keyed by parameter name (manifests checked by ``trust`` in signed runs).
    Returns (params, {fragment: version})."""
    values: dict[int, Tensors] = {}
    versions: dict[int, int] = {}
    for p in range(plan.num_fragments):
        version = ledger.latest_version(store, p)
        if version is None:
            raise ProtocolError(f"{store.url}: fragment {p} has no committed version (was `ddiloco init` interrupted?)")
        values[p] = FragmentReader(store, run_id=run_id, plan=plan, fragment=p, trust=trust).read(version)
        versions[p] = version
    return assemble_parameters(plan, values), versions


def load_global_model(store: Store, *, run_id: str, plan: FragmentPlan, model: torch.nn.Module,
                      trust: Trust | None = None) -> dict[int, int]:
    """Copy the latest global parameters into ``model`` (by parameter name). Returns versions."""
    params, versions = read_global_params(store, run_id=run_id, plan=plan, trust=trust)
    with torch.no_grad():
        for name, t in model.named_parameters():
            t.copy_(params[name].to(t.dtype))
    return versions
