"""outer_lr_scaling = participation: a merge of m of M live learners steps with lr*m/M."""

from __future__ import annotations

import uuid

import pytest

from ddiloco_cli.ops.runinit import RunSpec, init_run
from ddiloco_cli.store import open_store
from ddiloco_cli.syncer.core import Syncer, SyncerOptions


@pytest.mark.parametrize("scaling", ["participation", "none"])
def test_outer_lr_follows_participation(scaling):
    store = open_store(f"memory://lr-{uuid.uuid4().hex}")
    init_run(store, RunSpec(num_fragments=2, sync_every=4, outer_lr=0.8, outer_lr_scaling=scaling))
    s = Syncer(store, options=SyncerOptions(gc=False))
    s.learners.live = {"a", "b", "c", "d"}
    want = {1: 0.2, 2: 0.4, 4: 0.8, 5: 0.8} if scaling == "participation" else {1: 0.8, 2: 0.8, 4: 0.8, 5: 0.8}
    assert {m: s.decider.outer_lr(m) for m in want} == pytest.approx(want)
    s.learners.live = set()  # nobody known alive (no heartbeats yet): no scaling
    assert s.decider.outer_lr(1) == pytest.approx(0.8)


def test_unknown_scaling_is_refused_naming_the_flag():
    with pytest.raises(Exception, match="--outer-lr-scaling"):
        RunSpec(outer_lr_scaling="sqrt").check()
