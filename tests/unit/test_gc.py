"""`ddiloco gc` (ddiloco_cli/syncer/gc.py): retention after several versions and checkpoints.

Run: 2 fragments, 5 merges each (version v merges alice's contribution seq v-1),
checkpoints every 2 versions (2 and 4), keyframes every 2, retain_versions 2,
max_staleness 1, gc_grace 60 s. Every object is then aged 120 s (past the grace).
So keep_from = keyframe_floor(min(5 - 2 + 1, 4 - 1)) = 2: versions 0-1, checkpoint 2
and contributions merged at or before version 4 (seq <= 3) go.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import pytest
import torch

from ddiloco_cli.errors import ProtocolError, UsageError
from ddiloco_cli.ops.observe import verify_run
from ddiloco_cli.protocol import layout, ledger, records
from ddiloco_cli.protocol.runconfig import RunConfig
from ddiloco_cli.store import open_store
from ddiloco_cli.syncer.core import Syncer, SyncerOptions
from ddiloco_cli.syncer.gc import collect_garbage

from support.built_run import LEARNER, build_run, copy_run, invoke, latest_values, write_contribution

GRACE_S = 60.0


def _age_all(root: str, seconds: float) -> None:
    t = time.time() - seconds
    for dirpath, _, files in os.walk(root):
        for name in files:
            os.utime(os.path.join(dirpath, name), (t, t))


def _keys(store) -> set[str]:
    return {i.key for i in store.list("")}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    built = build_run(str(tmp_path_factory.mktemp("template") / "run"), rounds=5, checkpoint_every=2,
                      keyframe_every=2, retain_versions=2, max_staleness=1, gc_grace_s=GRACE_S)
    _age_all(built.url, 2 * GRACE_S)
    return built


@pytest.fixture
def built(template, tmp_path):
    built = copy_run(template, str(tmp_path / "run"))
    # young objects a writer may still be finishing, and old orphans
    built.young_orphan = layout.payload_key(0, 8, "full", "aaaaaaaaaaaa")
    built.old_orphan = layout.payload_key(0, 4, "full", "bbbbbbbbbbbb")
    built.pending = write_contribution(built.store, built.run, built.plan, fragment=0, seq=5, base_version=5)
    for key in (built.young_orphan, built.old_orphan, layout.CLOCK_PREFIX + "old", layout.CLOCK_PREFIX + "young"):
        built.store.put(key, b"x")
    for key in (built.old_orphan, layout.CLOCK_PREFIX + "old"):
        t = time.time() - 2 * GRACE_S
        os.utime(os.path.join(built.url, key), (t, t))
    return built


def expected_deleted(built) -> set[str]:
    keys = _keys(built.store)
    out = {built.old_orphan, layout.CLOCK_PREFIX + "old"}
    for key in keys:
        v = layout.parse_num(key)
        # every merge used the then-current base: the replay from checkpoint 4 reads nothing older
        if ("/manifests/" in key or "/payloads/" in key) and v is not None and v < 4:
            out.add(key)
        if key.startswith("checkpoints/") and v == 2:
            out.add(key)
        parsed = layout.parse_contribution_key(key)
        if parsed is not None and parsed[2] <= 3:  # merged at or before the checkpoint (version 4)
            out.add(key)
    return out


def test_gc_keeps_what_readers_and_a_restarting_syncer_need(built):
    before = latest_values(built)
    want = expected_deleted(built)
    assert len([k for k in want if k.startswith("contributions/")]) == 8
    result = invoke("gc", built.url)
    assert result.exit_code == 0, result.output
    keys = _keys(built.store)
    assert not (want & keys), sorted(want & keys)
    for p in range(2):
        assert ledger.list_versions(built.store, p) == [4, 5]
        assert [k for k in keys if k.startswith(layout.checkpoint_prefix(p))] == [
            k for k in keys if k.startswith(layout.checkpoint_prefix(p) + layout.num(4))]
        assert layout.contribution_key(p, LEARNER, 4) in keys  # merged after the checkpoint: replay needs it
    assert built.young_orphan in keys and built.pending in keys and layout.CLOCK_PREFIX + "young" in keys

    # the latest version reads back bit-identically and the bucket verifies clean
    after = latest_values(built)
    for p in before:
        for k in before[p]:
            assert torch.equal(before[p][k], after[p][k])
    assert verify_run(built.store) == []

    # a syncer restarting now restores the same outer momentum from checkpoint 4 + ledger replay
    restored = Syncer(open_store(built.url), options=SyncerOptions(syncer_id="restart", gc=False))
    restored.restore()
    for p, state in built.syncer.states.items():
        assert restored.states[p].version == 5
        want_m, got_m = state.outer.state_tensors(), restored.states[p].outer.state_tensors()
        assert set(want_m) == set(got_m)
        for k in want_m:
            assert torch.equal(want_m[k], got_m[k]), k


def test_gc_deletes_exactly_the_expected_set(built):
    report = collect_garbage(built.store, config=RunConfig.from_record(built.run), dry_run=True)
    assert set(report.deleted) == expected_deleted(built)
    assert report.keep_from == {0: 4, 1: 4}


def test_dry_run_deletes_nothing(built):
    keys = _keys(built.store)
    result = invoke("gc", built.url, "--dry-run")
    assert result.exit_code == 0, result.output
    assert _keys(built.store) == keys
    assert "would delete" in result.output and built.old_orphan in result.output


def test_young_objects_survive(tmp_path, template):
    # the same run, but nothing aged: only the version retention applies
    built = copy_run(template, str(tmp_path / "fresh"))
    _age_all(built.url, 0)
    report = collect_garbage(built.store, config=RunConfig.from_record(built.run))
    assert report.deleted, "old manifests and payloads go regardless of age"
    assert all(k.startswith("fragments/") for k in report.deleted), report.deleted
    assert all(layout.parse_num(k) < 4 for k in report.deleted)
    assert verify_run(built.store) == []


def test_no_checkpoint_means_nothing_but_orphans_go(tmp_path):
    built = build_run(str(tmp_path / "run"), rounds=2, checkpoint_every=100, retain_versions=1, max_staleness=1,
                      gc_grace_s=GRACE_S)
    _age_all(built.url, 2 * GRACE_S)
    report = collect_garbage(built.store, config=RunConfig.from_record(built.run))
    assert report.deleted == [] and report.keep_from == {0: 0, 1: 0}


def test_gc_deletes_temp_files_of_dead_writers_after_the_grace(built):
    # a writer killed mid-write leaves a temp file; one still writing has a young one
    directory = os.path.join(built.url, "fragments", "p00000", "payloads")
    dead, live = os.path.join(directory, ".tmp-dead"), os.path.join(directory, ".tmp-live")
    for path in (dead, live):
        with open(path, "wb") as f:
            f.write(b"partial")
    t = time.time() - 2 * GRACE_S
    os.utime(dead, (t, t))
    dry = collect_garbage(built.store, config=RunConfig.from_record(built.run), dry_run=True)
    assert "fragments/p00000/payloads/.tmp-dead" in dry.deleted and os.path.exists(dead)
    report = collect_garbage(built.store, config=RunConfig.from_record(built.run))
    assert "fragments/p00000/payloads/.tmp-dead" in report.deleted
    assert not os.path.exists(dead) and os.path.exists(live)
    assert not any(".tmp-live" in k for k in report.deleted)


@pytest.mark.parametrize("grace_s", [0.0, -300.0, float("nan")])
def test_gc_refuses_a_grace_that_is_not_positive(built, grace_s):
    """GC takes a RunConfig, and there is none with such a grace: not from flags, code
    or a run.json in the bucket; `ddiloco gc` on that bucket deletes nothing."""
    keys = _keys(built.store)
    with pytest.raises(UsageError, match="--gc-grace"):
        dataclasses.replace(RunConfig.from_record(built.run), gc_grace_s=grace_s)
    with pytest.raises(ProtocolError, match="gc-grace"):
        RunConfig.from_record({**built.run, "gc_grace_s": grace_s})
    if math.isfinite(grace_s):  # JSON has no NaN
        built.store.put(layout.RUN_CONFIG, records.dumps({**built.run, "gc_grace_s": grace_s}))
        result = invoke("gc", built.url)
        assert result.exit_code != 0 and "gc-grace" in result.output, result.output
    assert _keys(built.store) == keys
