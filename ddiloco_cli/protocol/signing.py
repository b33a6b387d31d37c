"""Authenticated bucket objects: ed25519 keys, admissions and signatures.

The bucket is a trust boundary (PROTOCOL.md, "Signatures"): in a run whose
``run.json`` sets ``require_signatures``, a contribution counts only when the
key that signed it was admitted for its learner id by the run's admin key.

* ``ddiloco init`` makes (or reuses) the admin key; ``run.json`` holds its
  public key (``admin_key``). The private key never enters the bucket.
* ``ddiloco admit`` writes ``admissions/ID.json``: ID's public key and role
  (``learner`` or ``syncer``), signed by the admin key.
* Learners sign contributions and heartbeats, syncers sign epochs and manifests.

The signed message binds the object's bytes to its kind, its run, its key in
the bucket and the signer's public key, so a signature is worth nothing
anywhere else (another run, another learner id or seq, another object type)::

    DOMAIN || lp(kind) || lp(run_id) || lp(object key) || lp(public key hex) || sha256(body)

with ``lp(x)`` = 4-byte big-endian length then the UTF-8 bytes. The body of a
JSON record is its canonical form (``records.dumps``) without the
``signature`` field; the body of a safetensors payload is the 8-byte LE length
of its canonical header JSON without the ``__metadata__.ddiloco_sig`` entry,
that header, then the data section as stored. A verifier re-derives both from
the parsed object, so it never unpickles and parses nothing beyond the
payload's bounded header.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import stat
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Collection, Mapping

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ddiloco_cli.clock import WALL, Clock
from ddiloco_cli.errors import InvalidPayloadError, ProtocolError, UsageError
from ddiloco_cli.numerics.container import parse_safetensors
from ddiloco_cli.protocol import layout, records
from ddiloco_cli.store.base import NotFound, Store

DOMAIN = b"ddiloco signature v1\n"
ALG = "ed25519"
RECORD_FIELD = "signature"  # in a JSON record
PAYLOAD_FIELD = "ddiloco_sig"  # in a safetensors payload's __metadata__ (a JSON string)
ROLES = ("learner", "syncer")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX128 = re.compile(r"[0-9a-f]{128}")


RunLike = Any  # a run.json record (a Mapping) or a RunConfig


class SignatureError(ProtocolError):
    """An object is unsigned, signed by a key not admitted for it, or forged. The
    message says which; the syncer quarantines such a contribution."""


# ---------------------------------------------------------------------- keys
@functools.cache
def _ed25519() -> SimpleNamespace:
    """cryptography's ed25519 keys, serialization and InvalidSignature, imported on first use: a
    run without signatures never loads them (4.5 MB of every learner's and syncer's memory)."""
    from cryptography.exceptions import InvalidSignature  # noqa: PLC0415 - see above
    from cryptography.hazmat.primitives import serialization  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (  # noqa: PLC0415
        Ed25519PrivateKey, Ed25519PublicKey)

    return SimpleNamespace(InvalidSignature=InvalidSignature, serialization=serialization,
                           Ed25519PrivateKey=Ed25519PrivateKey, Ed25519PublicKey=Ed25519PublicKey)


@dataclass(frozen=True)
class Signer:
    """A private key and its public key (64 lowercase hex digits)."""

    private: Ed25519PrivateKey
    public_key: str
    path: Path | None = None  # the key file it came from

    @classmethod
    def from_private(cls, private: Ed25519PrivateKey, *, path: Path | None = None) -> "Signer":
        serialization = _ed25519().serialization
        raw = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return cls(private, raw.hex(), path)


def parse_public_key(text: str, *, what: str = "public key") -> str:
    """A public key as 64 lowercase hex digits (what ``ddiloco keys new`` prints)."""
    key = text.strip().lower()
    if not _HEX64.fullmatch(key):
        raise UsageError(f"{what} {text.strip()[:80]!r}: expected 64 hex digits, as printed by `ddiloco keys new`")
    return key


def new_key(path: str | os.PathLike) -> Signer:
    """Create an ed25519 keypair: the private key as PEM (PKCS#8) at ``path``, mode
    0600, never overwriting; the public key as hex at ``path.pub``."""
    path = Path(path).expanduser()
    crypto = _ed25519()
    serialization = crypto.serialization
    signer = Signer.from_private(crypto.Ed25519PrivateKey.generate(), path=path)
    pem = signer.private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption())
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise UsageError(f"{path} already exists; nothing was changed (choose another path or delete it)") from None
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    Path(f"{path}.pub").write_text(signer.public_key + "\n")
    return signer


def load_key(path: str | os.PathLike, *, what: str = "key") -> Signer:
    """The private key at ``path`` (PEM PKCS#8 ed25519). UsageError when it is missing,
    unreadable, group/world-readable or not an ed25519 private key."""
    path = Path(path).expanduser()
    try:
        mode = path.stat().st_mode
        data = path.read_bytes()
    except FileNotFoundError:
        if what == "admin key":  # made by `ddiloco init`, never by `keys new`
            raise UsageError(f"admin key {path}: no such file; the run's admin key is the one `ddiloco init` made "
                             "(its --admin-key, default ~/.config/ddiloco/admin.pem on the machine that ran it): "
                             "pass that file with --admin-key") from None
        raise UsageError(f"{what} {path}: no such file (create one with `ddiloco keys new {path}`)") from None
    except OSError as exc:
        raise UsageError(f"{what} {path}: cannot read it ({exc.strerror})") from None
    if _HEX64.fullmatch(data.strip().decode("ascii", "replace")):
        private_path = str(path).removesuffix(".pub")
        raise UsageError(f"{what} {path}: this is a public key; pass the private key file"
                         f"{f' ({private_path})' if private_path != str(path) else ''}")
    crypto = _ed25519()
    try:
        private = crypto.serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{what} {path}: not an unencrypted PEM private key ({exc})") from None
    if not isinstance(private, crypto.Ed25519PrivateKey):
        raise UsageError(f"{what} {path}: not an ed25519 key (create one with `ddiloco keys new`)")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UsageError(f"{what} {path}: other users can read this private key (mode {stat.S_IMODE(mode):o}); "
                         f"run `chmod 600 {path}`")
    return Signer.from_private(private, path=path)


def default_admin_key_path() -> Path:
    """$XDG_CONFIG_HOME/ddiloco/admin.pem (default ~/.config/ddiloco/admin.pem)."""
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "ddiloco" / "admin.pem"


def load_admin_key(path: str | os.PathLike | None, *, create: bool) -> Signer:
    """The admin key at ``path`` (default: ``default_admin_key_path()``); with ``create``,
    a missing file is created first (``ddiloco init``)."""
    path = Path(path).expanduser() if path else default_admin_key_path()
    if create and not path.exists():
        return new_key(path)
    return load_key(path, what="admin key")


def default_require_signatures(url: str) -> bool:
    """On for cloud buckets (s3://, gs://), whose write access is shared by many
    machines and credentials; off for local paths."""
    return url.strip().lower().startswith(("s3://", "gs://", "gcs://"))


# ------------------------------------------------------------ sign / verify
def message(*, kind: str, run_id: str, key: str, public_key: str, digest: bytes) -> bytes:
    """The exact bytes an ed25519 signature covers (see the module docstring)."""
    parts = [DOMAIN]
    for field in (kind, run_id, key, public_key):
        b = field.encode()
        parts += [struct.pack(">I", len(b)), b]
    return b"".join([*parts, digest])


def _signature_value(signer: Signer, msg: bytes) -> dict[str, str]:
    return {"alg": ALG, "key": signer.public_key, "sig": signer.private.sign(msg).hex()}


def _check(sig: Any, msg_for_key, *, allowed: Collection[str], where: str) -> str:
    """Verify a signature value against the keys in ``allowed``; return the signer's key."""
    if sig is None:
        raise SignatureError(f"{where}: unsigned, but this run requires signatures")
    if (not isinstance(sig, dict) or sig.get("alg") != ALG or not isinstance(sig.get("key"), str)
            or not _HEX64.fullmatch(sig["key"]) or not isinstance(sig.get("sig"), str)
            or not _HEX128.fullmatch(sig["sig"])):
        raise SignatureError(f"{where}: malformed signature (expected alg ed25519, 64-hex key, 128-hex sig)")
    if sig["key"] not in allowed:
        raise SignatureError(f"{where}: signed by key {sig['key'][:16]}..., but " + (
            "that is not the key admitted for its writer" if allowed else
            "its writer is not admitted to this run (`ddiloco admit URL ID PUBKEY`)"))
    crypto = _ed25519()
    try:
        crypto.Ed25519PublicKey.from_public_bytes(bytes.fromhex(sig["key"])).verify(bytes.fromhex(sig["sig"]),
                                                                                    msg_for_key(sig["key"]))
    except crypto.InvalidSignature:
        raise SignatureError(f"{where}: forged or altered: the signature does not match its content") from None
    return sig["key"]


def _record_digest(record: dict[str, Any]) -> bytes:
    return hashlib.sha256(records.dumps({k: v for k, v in record.items() if k != RECORD_FIELD})).digest()


def sign_record(record: dict[str, Any], *, run_id: str, key: str, signer: Signer) -> dict[str, Any]:
    """``record`` plus its ``signature`` (kind: the record's ``format``; ``key``: where it will be written)."""
    msg = message(kind=record["format"], run_id=run_id, key=key, public_key=signer.public_key,
                  digest=_record_digest(record))
    return {**record, RECORD_FIELD: _signature_value(signer, msg)}


def verify_record(record: dict[str, Any], *, run_id: str, key: str, allowed: Collection[str], where: str = "") -> str:
    """Check a (schema-valid) record's signature; return the signer's public key.
    Raises SignatureError naming ``where`` (default ``key``)."""
    try:
        digest = _record_digest(record)
    except (ValueError, TypeError, RecursionError) as exc:
        raise SignatureError(f"{where or key}: cannot canonicalise the record ({exc.__class__.__name__})") from None
    return _check(record.get(RECORD_FIELD), lambda pk: message(kind=str(record.get("format")), run_id=run_id, key=key,
                                                               public_key=pk, digest=digest),
                  allowed=allowed, where=where or key)


def _payload_parts(data: bytes, where: str) -> tuple[dict[str, Any], int, Any, bytes]:
    """(header without the signature entry, offset of the data section, the signature
    value or None, digest of the body)."""
    header, data_start = parse_safetensors(data, where)
    meta = header.get("__metadata__")
    meta = dict(meta) if isinstance(meta, dict) else meta
    sig = None
    if isinstance(meta, dict) and PAYLOAD_FIELD in meta:
        try:
            sig = json.loads(meta.pop(PAYLOAD_FIELD))
        except (TypeError, ValueError, RecursionError):
            sig = "unparsable"
        header = {**header, "__metadata__": meta}
    try:
        canon = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    except (ValueError, TypeError, RecursionError) as exc:
        raise SignatureError(f"{where}: cannot canonicalise the payload header ({exc.__class__.__name__})") from None
    h = hashlib.sha256(struct.pack("<Q", len(canon)))
    h.update(canon)
    h.update(memoryview(data)[data_start:])
    return header, data_start, sig, h.digest()


def sign_payload(data: bytes, *, kind: str, run_id: str, key: str, signer: Signer) -> bytes:
    """A copy of safetensors ``data`` whose ``__metadata__`` carries the signature. The
    data section is unchanged; the header is rewritten canonically."""
    header, data_start, _, digest = _payload_parts(data, "own payload")
    msg = message(kind=kind, run_id=run_id, key=key, public_key=signer.public_key, digest=digest)
    sig = json.dumps(_signature_value(signer, msg), sort_keys=True, separators=(",", ":"))
    header["__metadata__"] = {**(header.get("__metadata__") or {}), PAYLOAD_FIELD: sig}
    hbytes = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)  # safetensors aligns the data section to 8 bytes
    return b"".join([struct.pack("<Q", len(hbytes)), hbytes, memoryview(data)[data_start:]])


def verify_payload(data: bytes, *, kind: str, run_id: str, key: str, allowed: Collection[str], where: str = "") -> str:
    """Check a signed payload; return the signer's public key. Raises SignatureError,
    or InvalidPayloadError when the header itself cannot be parsed."""
    where = where or key
    _, _, sig, digest = _payload_parts(data, where)
    return _check(sig, lambda pk: message(kind=kind, run_id=run_id, key=key, public_key=pk, digest=digest),
                  allowed=allowed, where=where)


# --------------------------------------------------------------- admissions
def _run_fields(run: RunLike) -> tuple[str, Mapping[str, Any]]:
    """(run_id, fields) of a run.json record or a RunConfig (which keeps the
    signature fields among its ``extra`` keys)."""
    if isinstance(run, Mapping):
        return run["run_id"], run
    return run.run_id, run.extra


def run_id_of(run: RunLike) -> str:
    return _run_fields(run)[0]


def requires_signatures(run: RunLike) -> bool:
    """Whether a run (run.json record or RunConfig) requires signatures."""
    return _run_fields(run)[1].get("require_signatures") is True


def admin_key_of(run: RunLike) -> str:
    """The run's admin public key. ProtocolError when run.json has none (or a bad one)."""
    key = _run_fields(run)[1].get("admin_key")
    if not isinstance(key, str) or not _HEX64.fullmatch(key):
        raise ProtocolError("run.json has no valid admin_key (64 hex digits): this run cannot admit keys "
                            "(create it with `ddiloco init --require-signatures`)")
    return key


def revoke(store: Store, *, run: RunLike, member_id: str, admin: Signer) -> None:
    """Delete ``admissions/ID.json`` (``ddiloco admit --revoke``): readers stop accepting the id's
    key within their ``Trust.max_age_s``; its later contributions are quarantined. Only with the
    run's admin key, and only an id that is admitted."""
    expected = admin_key_of(run)
    if admin.public_key != expected:
        raise UsageError(f"this admin key ({admin.public_key[:16]}...) is not the run's ({expected[:16]}...): "
                         "pass the key `ddiloco init` used with --admin-key")
    key = layout.admission_key(member_id)
    if not layout.valid_learner_id(member_id) or not any(i.key == key for i in store.list(key)):
        raise UsageError(f"{member_id!r} is not admitted in this run at {store.url}: nothing to revoke")
    store.delete(key)


def admit(store: Store, *, run: RunLike, member_id: str, public_key: str, role: str, admin: Signer,
          clock: Clock = WALL) -> dict[str, Any]:
    """Write ``admissions/ID.json``: ``public_key`` may sign as ``member_id`` in ``role``.
    Re-admitting an id replaces its key (rotation). Returns the record."""
    if not layout.valid_learner_id(member_id):
        raise UsageError(f"id {member_id!r}: use 1-64 letters, digits, '.', '_' or '-'")
    if role not in ROLES:
        raise UsageError(f"--role {role!r}: use one of {', '.join(ROLES)}")
    public_key = parse_public_key(public_key)
    expected = admin_key_of(run)
    if admin.public_key != expected:
        raise UsageError(f"this admin key ({admin.public_key[:16]}...) is not the run's ({expected[:16]}...): "
                         "pass the key `ddiloco init` used with --admin-key")
    key = layout.admission_key(member_id)
    run_id = _run_fields(run)[0]
    record = records.make("admission", run_id=run_id, id=member_id, role=role, public_key=public_key,
                          nonce=records.new_nonce(), created_s=clock.time())
    record = sign_record(record, run_id=run_id, key=key, signer=admin)
    store.put(key, records.dumps(record))
    return record


class KeyRing:
    """The run's admitted keys, read from ``admissions/`` and checked against the admin
    key. Invalid or forged admissions are skipped (``problems`` says why)."""

    def __init__(self, store: Store, *, run: RunLike):
        self.store, self.run_id, self.admin_key = store, _run_fields(run)[0], admin_key_of(run)
        self.members: dict[str, tuple[str, str]] = {}  # id -> (role, public key)
        self.problems: dict[str, str] = {}
        self._seen: dict[str, tuple[int, float]] = {}  # key -> (size, mtime) of the object last read

    def refresh(self, *, member_id: str | None = None) -> None:
        """Re-read admissions that are new or changed since the last refresh (one LIST),
        and ``member_id``'s in any case (a rewrite within the store's mtime resolution
        with an equal size would otherwise go unnoticed)."""
        infos = {i.key: i for i in self.store.list(layout.ADMISSION_PREFIX)}
        for gone in set(self._seen) - set(infos):
            self._seen.pop(gone)
            self._forget(gone)
        forced = layout.admission_key(member_id) if member_id is not None else None
        for key, info in infos.items():
            if self._seen.get(key) == (info.size, info.mtime_s) and key != forced:
                continue
            self._forget(key)
            try:
                rec = records.loads(self.store.get(key), "admission", where=key)
                if key != layout.admission_key(rec["id"]) or rec["run_id"] != self.run_id:
                    raise SignatureError(f"{key}: admits {rec['id']!r} of run {rec['run_id']}, not this key and run")
                verify_record(rec, run_id=self.run_id, key=key, allowed=(self.admin_key,))
                self.members[rec["id"]] = (rec["role"], rec["public_key"])
            except (NotFound, ProtocolError, InvalidPayloadError) as exc:
                self.problems[key] = str(exc)
            self._seen[key] = (info.size, info.mtime_s)  # not on a store error: retried next refresh

    def _forget(self, key: str) -> None:
        self.problems.pop(key, None)
        member = key[len(layout.ADMISSION_PREFIX):-len(".json")]
        self.members.pop(member, None)

    def keys_of(self, member_id: str, *, role: str) -> tuple[str, ...]:
        """The public key admitted for ``member_id`` in ``role`` (empty when none)."""
        got = self.members.get(member_id)
        return (got[1],) if got is not None and got[0] == role else ()

    def keys_with_role(self, role: str) -> frozenset[str]:
        return frozenset(pk for r, pk in self.members.values() if r == role)


class Trust:
    """What one run accepts from the bucket. Without ``require_signatures`` every check
    passes (and nothing is read); with it, an object counts only when signed by the key
    admitted for its writer. Admissions are re-read when a check fails (at most every
    ``refresh_s``), so a newly admitted key is accepted at once, and at least every
    ``max_age_s``, so a rotated or revoked key stops being accepted within that time."""

    def __init__(self, store: Store, *, run: RunLike, refresh_s: float = 1.0, max_age_s: float = 5.0,
                 clock: Clock = WALL):
        self.clock = clock
        self.required = requires_signatures(run)
        self.run_id = _run_fields(run)[0]
        self.ring = KeyRing(store, run=run) if self.required else None
        self.refresh_s, self.max_age_s = refresh_s, max_age_s
        self._refreshed_t = -float("inf")
        self._lock = threading.Lock()  # a learner checks manifests from its receiver thread too

    def _refresh(self, member_id: str | None) -> None:
        with self._lock:
            self._refreshed_t = self.clock.monotonic()
            self.ring.refresh(member_id=member_id)

    def _retry_fresh(self, check, member_id: str | None) -> str:
        if self.clock.monotonic() - self._refreshed_t > self.max_age_s:
            self._refresh(None)
        try:
            return check()
        except SignatureError:
            if self.clock.monotonic() - self._refreshed_t < self.refresh_s:
                raise
        self._refresh(member_id)
        return check()

    def _allowed(self, member_id: str | None, role: str) -> Collection[str]:
        if member_id is not None:
            return self.ring.keys_of(member_id, role=role)
        # init signs version 0 with the admin key, which stands above every syncer
        return self.ring.keys_with_role(role) | ({self.ring.admin_key} if role == "syncer" else set())

    def check_payload(self, data: bytes, *, kind: str, key: str, member_id: str, where: str = "") -> None:
        """Raise SignatureError unless ``data`` (at ``key``) is signed by ``member_id``'s learner key."""
        if self.required:
            self._retry_fresh(lambda: verify_payload(data, kind=kind, run_id=self.run_id, key=key,
                                                     allowed=self._allowed(member_id, "learner"), where=where),
                              member_id)

    def check_member(self, member_id: str, *, role: str, where: str = "") -> None:
        """Raise SignatureError unless ``member_id`` has a key admitted in ``role``: without one
        nothing it writes can carry a valid signature, so its objects need not be read."""
        def check() -> None:
            if not self._allowed(member_id, role):
                raise SignatureError(f"{where}: {role} {member_id!r} is not admitted to this run (`ddiloco admit "
                                     "URL ID PUBKEY`), so nothing it writes can carry a valid signature")
        if self.required:
            self._retry_fresh(check, member_id)

    def check_record(self, record: dict[str, Any], *, key: str, role: str, member_id: str | None = None,
                     where: str = "") -> None:
        """Raise SignatureError unless ``record`` (at ``key``) is signed by ``member_id``'s key
        in ``role`` (any key admitted in ``role`` when ``member_id`` is None)."""
        if self.required:
            self._retry_fresh(lambda: verify_record(record, run_id=self.run_id, key=key,
                                                    allowed=self._allowed(member_id, role), where=where),
                              member_id)

    def admits(self, record: dict[str, Any], *, key: str, role: str, member_id: str | None = None) -> bool:
        """``check_record`` as a yes/no, for inputs that are skipped rather than reported (heartbeats)."""
        try:
            self.check_record(record, key=key, role=role, member_id=member_id)
        except SignatureError:
            return False
        return True


def signer_for_run(store: Store, *, run: RunLike, key_path: str | os.PathLike | None, member_id: str | None,
                   role: str) -> Signer | None:
    """The key a learner or syncer signs with in this run: None when the run does not
    require signatures; else the key at ``key_path``, which must be the one admitted for
    ``member_id`` in ``role`` (any id when None: syncer names need not be stable), checked
    now so that a wrong key fails at start, not at merge."""
    if not requires_signatures(run):
        return None
    flag = "--key"
    if key_path is None:
        raise UsageError(f"this run requires signatures: pass {flag} PATH (create a key with `ddiloco keys new PATH`; "
                         f"the run's admin admits it with `ddiloco admit {store.url} {member_id or 'NAME'} PUBKEY"
                         f"{' --role syncer' if role == 'syncer' else ''}`)")
    signer = load_key(key_path)
    ring = KeyRing(store, run=run)
    ring.refresh()
    admitted = ring.keys_of(member_id, role=role) if member_id is not None else ring.keys_with_role(role)
    if signer.public_key not in admitted:
        if member_id is None:
            what = f"{key_path}'s key ({signer.public_key[:16]}...) is not admitted as a {role} key in this run"
        else:
            have = f"key {next(iter(admitted))[:16]}..." if admitted else "no key"
            what = f"{role} {member_id!r} has {have} admitted in this run, not {key_path}'s ({signer.public_key[:16]}...)"
        raise UsageError(f"{what}: ask the run's admin to run `ddiloco admit {store.url} {member_id or 'NAME'} "
                         f"{signer.public_key}{' --role syncer' if role == 'syncer' else ''}`")
    return signer
