"""Size bounds of every read (PROTOCOL.md [R7]; ddiloco_cli/store/bounds.py)."""

from __future__ import annotations

import os

import pytest
import torch

from ddiloco_cli.numerics import codec
from ddiloco_cli.protocol import layout, ledger
from ddiloco_cli.store import ObjectTooLargeError, open_store
from ddiloco_cli.store.bounds import (
    RECORD_MAX_BYTES,
    SMALL_RECORD_MAX_BYTES,
    BoundedStore,
    max_bytes_for,
    tensor_max_bytes,
)
from ddiloco_cli.syncer import replay

from support.runs import beat, contribution, live_syncer, make_run, step


@pytest.fixture
def run_store(store_url):
    store = open_store(store_url("local"))
    make_run(store)
    return store


def _plan(store):
    return ledger.read_plan(store, run_id=ledger.read_run(store)["run_id"])


def test_bounds_by_key(run_store):
    plan = _plan(run_store)
    for p in range(plan.num_fragments):
        bound = tensor_max_bytes(plan, p)
        assert bound > plan.fragment_nbytes(p)
        for key in (layout.contribution_key(p, "a", 3), layout.payload_key(p, 2, "full", "n")):
            assert max_bytes_for(key, plan) == bound
            assert max_bytes_for(key, None) == RECORD_MAX_BYTES  # no plan yet
        # a checkpoint holds momentum, the raw value and the open cycle's gradient
        assert max_bytes_for(layout.checkpoint_key(p, 2, "n"), plan) == tensor_max_bytes(plan, p, copies=3) > bound
    assert max_bytes_for(layout.contribution_key(plan.num_fragments, "a", 0), plan) == RECORD_MAX_BYTES
    for key in (layout.learner_heartbeat_key("a"), layout.learner_state_key("a"), layout.epoch_key(1),
                layout.syncer_heartbeat_key(1), layout.latest_hint_key(0), layout.CLOCK_PREFIX + "x"):
        assert max_bytes_for(key, plan) == SMALL_RECORD_MAX_BYTES
    for key in (layout.RUN_CONFIG, layout.PLAN, layout.manifest_key(0, 1), layout.quarantine_key("x")):
        assert max_bytes_for(key, plan) == RECORD_MAX_BYTES


def test_the_largest_legitimate_contribution_fits(run_store):
    # incompressible fp32 values: the codec's worst case
    plan = _plan(run_store)
    p = 0
    tensors = {k: torch.randn(shape) for k, shape in plan.fragment_shapes(p).items()}
    data = codec.encode_tensors(tensors, codec="none", metadata={"x": "y" * 1000})
    assert len(data) <= tensor_max_bytes(plan, p)
    key, data, _ = contribution(run_store, p, "a", 0, tensors=tensors)
    assert run_store.get(key) == data


def test_the_largest_legitimate_checkpoint_fits(run_store):
    plan = _plan(run_store)
    shapes = replay.checkpoint_shapes(plan, 0)
    data = codec.encode_tensors({k: torch.randn(s) for k, s in shapes.items()}, codec="none", metadata={"x": "y"})
    assert len(data) <= max_bytes_for(layout.checkpoint_key(0, 2, "n"), plan)


def test_bounded_store_finds_the_plan_itself(run_store):
    plan = _plan(run_store)
    fresh = open_store(run_store.url)
    assert isinstance(fresh, BoundedStore)
    key = layout.payload_key(0, 7, "full", "big")
    too_big = tensor_max_bytes(plan, 0) + 1
    fresh.put_if_absent(key, b"\0" * too_big)
    with pytest.raises(ObjectTooLargeError) as info:
        fresh.get(key)
    assert (info.value.size, info.value.max_bytes) == (too_big, too_big - 1)


def test_oversized_contribution_is_quarantined_and_the_syncer_goes_on(run_store):
    # finding: a 2 GiB contribution took the syncer to 2.36 GB; now it is refused unread
    plan = _plan(run_store)
    beat(run_store, "a")
    big = layout.contribution_key(0, "mallory", 0)
    run_store.put_if_absent(big, os.urandom(1024) * (tensor_max_bytes(plan, 0) // 1024 + 1))
    s = live_syncer(run_store)
    contribution(run_store, 0, "a", 0)
    assert step(s, 0)
    (report,) = run_store.list("quarantine/")
    assert report.key == layout.quarantine_key(big)
    assert b"bound" in run_store.get(report.key)
    m = ledger.read_manifest(run_store, 0, 1)
    assert [e["learner_id"] for e in m["contributions"] if e["used"]] == ["a"]
