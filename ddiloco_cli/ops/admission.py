"""Admitting a fleet to a run that requires signatures: ``admit --from-file`` (many ids at
once), ``learn --wait-for-admission`` (a learner that makes its key, prints it and waits
for the admin), and the list of admissions (``keys list``, ``inspect``)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable

from ddiloco_cli.errors import DdilocoError, UsageError
from ddiloco_cli.protocol import layout, records, signing
from ddiloco_cli.store.base import NotFound, Store

MAX_FILE_LINES = 100_000  # ids in one --from-file


def fingerprint(public_key: str) -> str:
    """The short form messages print: the public key's first 16 hex digits."""
    return public_key[:16]


def list_admissions(store: Store, *, run: signing.RunLike) -> list[dict[str, Any]]:
    """Every admission in the run, sorted by id: {id, role, public_key, fingerprint,
    admitted_s, problem} (``problem`` is None for a valid one signed by the run's admin
    key, else why it does not count). [] for a run without signatures."""
    if not signing.requires_signatures(run):
        return []
    admin, run_id = signing.admin_key_of(run), signing.run_id_of(run)
    out = []
    for info in store.list(layout.ADMISSION_PREFIX):
        entry: dict[str, Any] = {"id": info.key[len(layout.ADMISSION_PREFIX):].removesuffix(".json"), "role": None,
                                 "public_key": None, "fingerprint": None, "admitted_s": None, "problem": None}
        try:
            rec = records.loads(store.get(info.key), "admission", where=info.key)
            entry.update(id=rec["id"], role=rec["role"], public_key=rec["public_key"],
                         fingerprint=fingerprint(rec["public_key"]), admitted_s=rec.get("created_s"))
            if info.key != layout.admission_key(rec["id"]) or rec["run_id"] != run_id:
                raise signing.SignatureError(f"{info.key}: admits {rec['id']!r} of run {rec['run_id']}")
            signing.verify_record(rec, run_id=run_id, key=info.key, allowed=(admin,))
        except NotFound:
            continue  # removed since the LIST
        except DdilocoError as exc:
            entry["problem"] = str(exc)
        out.append(entry)
    return sorted(out, key=lambda e: e["id"])


def parse_admissions_file(path: str) -> list[tuple[str, str, str]]:
    """(id, public key, role) per line of ``path``: ``ID PUBKEY [learner|syncer]``; blank
    lines and ``#`` comments skipped. UsageError naming the line of the first bad one."""
    try:
        lines = Path(path).expanduser().read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--from-file {path}: {exc}") from None
    if len(lines) > MAX_FILE_LINES:
        raise UsageError(f"--from-file {path}: over {MAX_FILE_LINES} lines")
    out = []
    for n, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) not in (2, 3) or (len(fields) == 3 and fields[2] not in signing.ROLES):
            raise UsageError(f"--from-file {path}:{n}: want `ID PUBKEY [learner|syncer]`, got {line.strip()!r}")
        if not layout.valid_learner_id(fields[0]):
            raise UsageError(f"--from-file {path}:{n}: id {fields[0]!r}: use 1-64 letters, digits, '.', '_' or '-'")
        key = signing.parse_public_key(fields[1], what=f"--from-file {path}:{n} public key")
        out.append((fields[0], key, fields[2] if len(fields) == 3 else "learner"))
    if not out:
        raise UsageError(f"--from-file {path}: no `ID PUBKEY` line")
    return out


def key_for_admission(key_path: str) -> signing.Signer:
    """The key at ``key_path``, made there first when missing (a fresh fleet machine)."""
    path = Path(key_path).expanduser()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        return signing.new_key(path)
    return signing.load_key(path)


def wait_for_admission(store: Store, *, run: dict[str, Any], member_id: str, key_path: str | None, timeout_s: float,
                       say: Callable[[str], None], sleep: Callable[[float], None] = time.sleep,
                       monotonic: Callable[[], float] = time.monotonic) -> None:
    """Block until the key at ``key_path`` (made there when missing) is admitted for learner
    ``member_id``: says its public key and the admin's command once, then polls the
    admission with backoff (1 s doubling to 30 s). Returns at once in a run without
    signatures; UsageError after ``timeout_s`` (inf: never)."""
    if not signing.requires_signatures(run):
        return
    if key_path is None:
        raise UsageError("--wait-for-admission needs --key PATH (made there when missing)")
    signer = key_for_admission(key_path)
    ring = signing.KeyRing(store, run=run)
    ring.refresh(member_id=member_id)
    if signer.public_key in ring.keys_of(member_id, role="learner"):
        return
    say(f"learner {member_id} public key {signer.public_key}: waiting for the run's admin to run "
        f"`ddiloco admit {store.url} {member_id} {signer.public_key}`")
    start, pause = monotonic(), 1.0
    while signer.public_key not in ring.keys_of(member_id, role="learner"):
        waited = monotonic() - start
        if waited >= timeout_s:
            raise UsageError(f"learner {member_id}'s key was not admitted within {timeout_s:g} s; admit it with "
                             f"`ddiloco admit {store.url} {member_id} {signer.public_key}`")
        sleep(min(pause, max(0.0, timeout_s - waited)) if not math.isinf(timeout_s) else pause)
        pause = min(30.0, pause * 2)
        ring.refresh(member_id=member_id)
    say(f"learner {member_id} admitted")


__all__ = ["fingerprint", "key_for_admission", "list_admissions", "parse_admissions_file", "wait_for_admission"]
