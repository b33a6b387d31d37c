"""Bounded catch-up (issue 24 finding 6): a merge whose contributions cover k > 1 cycles each
(after a syncer outage) is applied once and loads the momentum buffer with one cycle's
worth (intake 1/k); an ordinary merge is the plain Nesterov step, bit for bit; a replay
reproduces a catch-up from the manifest's ``outer_intake``."""

from __future__ import annotations

import uuid

import pytest
import torch

from ddiloco_cli.numerics.outer import OuterOptimizer
from ddiloco_cli.protocol import ledger
from ddiloco_cli.store import open_store

from support.runs import assert_same_state, beat, contribution, live_syncer, make_run, restored

H = 2  # make_run's sync_every


def test_intake_one_is_the_plain_step_and_below_one_keeps_the_buffer_to_one_cycle():
    opt = OuterOptimizer(lr=0.7, momentum=0.9)
    p, g = {"w": torch.zeros(8)}, {"w": torch.ones(8)}
    p1, o1 = opt.stepped(p, g)
    p2, o2 = opt.stepped(p, g, intake=1.0)
    assert torch.equal(p1["w"], p2["w"]) and torch.equal(o1.momentum_buffers["w"], o2.momentum_buffers["w"])
    warm = o1.copy()  # buffer = g: one cycle of steady progress
    k = 10.0
    catch_up = {"w": torch.full((8,), k)}  # k cycles of progress in one gradient
    _, plain = warm.stepped(p1, catch_up)
    new, bounded = warm.stepped(p1, catch_up, intake=1 / k)
    assert float(plain.momentum_buffers["w"][0]) == pytest.approx(0.9 + k)  # k cycles loaded at once
    assert float(bounded.momentum_buffers["w"][0]) == pytest.approx(0.9 + 1.0)  # one cycle's worth
    step = float(p1["w"][0] - new["w"][0])
    assert step == pytest.approx(0.7 * (k + 0.9 * 1.9))  # the catch-up applied once, plus momentum
    assert bounded.num_steps == warm.num_steps + 1 and torch.equal(warm.momentum_buffers["w"], torch.ones(8))


def test_a_catch_up_merge_records_its_intake_and_replays_bit_exactly():
    """Two learners; one merge of ordinary sends (intake 1, no field), then both send catch-ups
    of 5 cycles each (a syncer outage): that merge records outer_intake 1/5, and a restarted
    syncer replays both versions to the same state, residual and momentum included."""
    store = open_store(f"memory://catchup-{uuid.uuid4().hex}")
    make_run(store, num_fragments=1, checkpoint_every=1000)
    for lid in ("a", "b"):
        beat(store, lid)
    s = live_syncer(store)
    for lid in ("a", "b"):
        contribution(store, 0, lid, 1, c_steps=H, c_tokens=H * 8)
    s.poll_contributions()
    s.decider.admit_pending(s.states[0])
    assert s.commit(s.states[0], grace_s=0.0)
    for lid in ("a", "b"):
        contribution(store, 0, lid, 2, base_version=1, c_steps=5 * H, c_tokens=5 * H * 8)
    s.poll_contributions()
    s.decider.admit_pending(s.states[0])
    assert s.commit(s.states[0], grace_s=0.0)
    m1, m2 = ledger.read_manifest(store, 0, 1), ledger.read_manifest(store, 0, 2)
    assert "outer_intake" not in m1 and m2["outer_intake"] == pytest.approx(0.2)
    assert_same_state(s, restored(store))
