"""Local store durability: every create fsyncs its data before the name appears and then
the directory entry, except a learner's contribution, which gets neither fsync (PROTOCOL.md,
"Store requirements" [S9]): a host crash may lose it or leave it torn under its name, and
every reader refuses a torn one as corrupt, so it is quarantined, never merged."""

from __future__ import annotations

import os

import pytest
import torch

import ddiloco_cli.store.local as local
from ddiloco_cli.errors import InvalidPayloadError
from ddiloco_cli.learner.uploader import contribution_bytes
from ddiloco_cli.numerics import codec
from ddiloco_cli.protocol import layout, records
from ddiloco_cli.protocol.published import expected_shapes
from ddiloco_cli.store import open_store

from support.runs import beat, live_syncer, make_run


def test_contribution_skips_both_fsyncs_manifest_and_payload_do_not(tmp_path, monkeypatch):
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
    assert len(synced_files) == 2 and all(".tmp-" in f for f in synced_files)  # the data, before the link
    assert synced_dirs == [os.path.dirname(keys["manifest"]), os.path.dirname(keys["payload"])]
    assert not any(name.startswith(".tmp-") for _, _, names in os.walk(tmp_path) for name in names)
    # a retried create of a contribution still settles by content [S2]
    assert store.put_if_absent(keys["contribution"], keys["contribution"].encode())
    assert not store.put_if_absent(keys["contribution"], b"other bytes")


def _torn(data: bytes, *, block: int = 4096) -> dict[str, bytes]:
    """What a host crash can leave of a file created without fsync: nothing of it, a prefix cut
    at a block (or anywhere), or its length with one block, or all of it, never written (zeros)."""
    out = {"empty": b"", "zeros": bytes(len(data))}
    for n in sorted({*range(block, len(data), block), 1, 8, 9, len(data) // 2, len(data) - 1}):
        out[f"cut at {n}"] = data[:n]
    for start in range(0, len(data), block):
        out[f"zeros at {start}"] = data[:start] + bytes(min(block, len(data) - start)) + data[start + block:]
    return out


def test_a_torn_contribution_never_decodes():
    """Every torn form of a real int4 contribution (three tensors, 11 blocks of 4 KiB) fails
    the decoder's checks with a message naming it: lengths, zstd content size and checksum."""
    g = torch.Generator().manual_seed(0)
    delta = {"w": 1e-3 * torch.randn(300, 256, generator=g), "b": 1e-3 * torch.randn(256, generator=g),
             "v": 1e-3 * torch.randn(64, 130, generator=g)}
    header = records.make("contribution", run_id="r", fragment=0, learner_id="a", seq=1, base_version=0,
                          c_tokens=1, c_steps=1, nonce="n", created_s=0.0)
    data = contribution_bytes(delta, header, codec_name="int4", block_size=64, key=layout.contribution_key(0, "a", 1))
    expected = {k: tuple(t.shape) for k, t in delta.items()}
    codec.decode_tensors(data, expected=expected, where="intact")  # the intact file decodes
    torn = _torn(data)
    assert len(torn) > 20
    for name, bad in torn.items():
        with pytest.raises(InvalidPayloadError, match=f"^{name}: "):
            codec.decode_tensors(bad, expected=expected, where=name)


def test_a_torn_contribution_is_quarantined_not_merged(tmp_path):
    """A local run after a host crash: each torn contribution left under its name is quarantined
    with a one-line reason; the learner's intact one is taken."""
    store = open_store(str(tmp_path))
    make_run(store, codec="int4", publish_codec="int4")
    beat(store, "a")
    run = records.loads(store.get(layout.RUN_CONFIG), "run", where="run")
    s = live_syncer(store)
    delta = {k: 0.01 * torch.randn(shape) for k, shape in expected_shapes(s.plan, 0).items()}

    def payload(seq: int) -> bytes:
        header = records.make("contribution", run_id=run["run_id"], fragment=0, learner_id="a", seq=seq,
                              base_version=0, c_tokens=64, c_steps=2, nonce=f"n{seq}", created_s=0.0)
        return contribution_bytes(delta, header, codec_name="int4", block_size=run["codec_block"],
                                  key=layout.contribution_key(0, "a", seq))

    torn = _torn(payload(10_000), block=64)  # a tiny task's contribution is under 4 KiB: cut it finer
    keys = {}
    for seq, (name, _) in enumerate(sorted(torn.items()), start=10_001):  # as long as 10_000: torn alike
        bad = _torn(payload(seq), block=64)[name]  # its own header (seq), torn the same way
        key = layout.contribution_key(0, "a", seq)
        path = os.path.join(str(tmp_path), *key.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:  # what the crash left under the name
            f.write(bad)
        keys[key] = name
    assert store.put_if_absent(layout.contribution_key(0, "a", 99_999), payload(99_999))
    reasons = {}
    report = s.intake.quarantine
    s.intake.quarantine = lambda key, reason, **kw: (reasons.__setitem__(key, reason), report(key, reason, **kw))
    s.poll_contributions()
    assert set(reasons) == set(keys)  # every torn one, nothing else
    for key, reason in reasons.items():
        assert reason.startswith(f"{store.url}/{key}: ") and "\n" not in reason, reason
        assert store.get(layout.quarantine_key(key))  # its report
    pending = [c.seq for cs in s.states[0].pending.values() for c in cs]
    assert pending == [99_999]
