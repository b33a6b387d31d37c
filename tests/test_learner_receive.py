"""The learner's receive rule: theta <- alpha*theta + (1-alpha)*(Theta_new + progress),
progress = what the overlap window trained after the send (kept or discarded by the run)."""

from __future__ import annotations

import uuid

import pytest
import torch

from ddiloco_cli.fragments import gather_fragment, scatter_fragment
from ddiloco_cli.learner import InFlight, Learner, LearnerOptions, Receiver
from ddiloco_cli.runinit import RunSpec, init_run
from ddiloco_cli.schedule import FragmentCounters
from ddiloco_cli.store import open_store


def _learner(keep: bool, alpha: float) -> tuple[Learner, dict[str, torch.Tensor]]:
    store = open_store(f"memory://recv-{uuid.uuid4().hex}")
    init_run(store, RunSpec(num_fragments=2, sync_every=4, overlap_steps=2, keep_overlap_progress=keep, alpha=alpha,
                            codec="none"))
    learner = Learner(store, options=LearnerOptions(learner_id="a"))
    model = learner.task.build_model()
    return learner, dict(model.named_parameters())


@pytest.mark.parametrize("keep,alpha", [(True, 0.0), (False, 0.0), (True, 0.5), (False, 0.5)])
def test_receive_keeps_or_discards_overlap_progress(keep, alpha):
    learner, params = _learner(keep, alpha)
    p = 1
    torch.manual_seed(0)
    theta_send = gather_fragment(learner.plan, p, params)
    progress = {k: torch.randn_like(v) * 0.01 for k, v in theta_send.items()}  # the tau steps after the send
    scatter_fragment(learner.plan, p, params, {k: theta_send[k] + progress[k] for k in theta_send})
    local = gather_fragment(learner.plan, p, params)
    new_global = {k: v + 1.0 for k, v in theta_send.items()}
    counters = FragmentCounters(2)
    for _ in range(5):
        counters.on_step(100)
    sent_at = (3, 300)  # snapshot at the send: 3 steps, 300 tokens

    receiver = Receiver(learner.store, {}, poll_s=1.0, stats=learner.stats)
    receiver.ready[p] = (7, new_global, {"high_water": {}})
    base = {p: (6, theta_send)}
    assert learner._receive(p, InFlight(5, 42, theta_send, sent_at), base, params, counters, receiver, block=False)

    got = gather_fragment(learner.plan, p, params)
    for k in got:
        target = new_global[k] + progress[k] if keep else new_global[k]
        want = alpha * local[k] + (1 - alpha) * target
        torch.testing.assert_close(got[k], want, rtol=0, atol=1e-6)
    assert base[p] == (7, new_global)
    assert counters.snapshot(p) == ((2, 200) if keep else (0, 0))  # only what the overlap window trained
    assert counters.snapshot(0) == (5, 500)
