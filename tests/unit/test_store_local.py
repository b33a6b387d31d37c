"""Local store durability: every create fsyncs its data before the name appears; the
directory entry is fsynced for every object but a learner's contribution (PROTOCOL.md,
"Store requirements": a host crash may lose a contribution, never tear one)."""

from __future__ import annotations

import os

import ddiloco_cli.store.local as local
from ddiloco_cli import layout


def test_contribution_skips_the_directory_fsync_manifest_and_payload_do_not(tmp_path, monkeypatch):
    synced_files: list[str] = []
    synced_dirs: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced_files.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(local.os, "fsync", fsync)
    monkeypatch.setattr(local, "_fsync_dir", lambda d: synced_dirs.append(os.path.relpath(d, tmp_path)))
    store = local.LocalStore(str(tmp_path))
    keys = {"contribution": layout.contribution_key(3, "a", 7), "manifest": layout.manifest_key(3, 1),
            "payload": layout.payload_key(3, 1, "delta", "n0")}
    for key in keys.values():
        assert store.put_if_absent(key, key.encode())
        assert store.get(key) == key.encode()
    assert len(synced_files) == 3 and all(".tmp-" in f for f in synced_files)  # the data, before the link
    assert synced_dirs == [os.path.dirname(keys["manifest"]), os.path.dirname(keys["payload"])]
    assert not any(name.startswith(".tmp-") for _, _, names in os.walk(tmp_path) for name in names)
