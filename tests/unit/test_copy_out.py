"""A CUDA learner's send copies its fragment out without waiting for the device
(``fragments.gather_fragment(non_blocking=True)``: pinned memory and an event): every reader of
that copy (the upload thread's outer gradient, the receiver's increment, the receive rule) must
wait for it first (``landed``). Here, without a device, copies that land late stand in: their
values are NaN until their event is waited for, so a reader that does not wait spreads NaNs.
The CUDA copies themselves are tested in tests/gpu (skipped without a device)."""

from __future__ import annotations

import uuid

import torch

from ddiloco_cli import DiLoCoSync, SyncOptions
from ddiloco_cli.learner import island as island_mod
from ddiloco_cli.learner.receiver import Receiver, difference, receive_rule
from ddiloco_cli.learner.sendpath import outer_gradient
from ddiloco_cli.learner.stats import LearnerStats
from ddiloco_cli.ops.runinit import RunSpec, init_run
from ddiloco_cli.protocol.fragments import CopyOut, gather_fragment, landed, plan_fragments
from ddiloco_cli.protocol.published import FragmentReader
from ddiloco_cli.store import open_store
from ddiloco_cli.tasks import load_task

TINY = "ddiloco_cli.tasks.gpt:tiny"


class _LateCopy:
    """An event whose copies land when it is waited for (the values are NaN until then)."""

    def __init__(self, out: CopyOut, real: dict[str, torch.Tensor], waits: list[int]):
        self.out, self.real, self.waits = out, real, waits

    def synchronize(self) -> None:
        for k, v in self.real.items():
            self.out[k].copy_(v)
        self.waits[0] += 1


def _late(real: dict[str, torch.Tensor], waits: list[int]) -> CopyOut:
    out = CopyOut({k: torch.full_like(v, float("nan")) for k, v in real.items()})
    out.event = _LateCopy(out, {k: v.clone() for k, v in real.items()}, waits)
    return out


def test_a_host_copy_is_ready_at_once_and_the_same_as_a_blocking_one():
    params = {"a": torch.randn(6, 4), "b": torch.randn(5).to(torch.bfloat16)}
    plan = plan_fragments({k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in params.items()}, 1)
    got = gather_fragment(plan, 0, params, non_blocking=True)
    want = gather_fragment(plan, 0, params)
    assert isinstance(got, CopyOut) and got.event is None and landed(got) is got
    assert got.keys() == want.keys()
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], want[k]) for k in want)
    params["a"].add_(1.0)  # a copy, not a view
    assert torch.equal(got["a"], want["a"])


def test_every_reader_of_a_send_waits_for_its_copy():
    waits = [0]
    real = {"w": torch.randn(64), "v": torch.randn(8, 3)}
    base = {k: torch.randn_like(v) for k, v in real.items()}
    residual = {k: 0.01 * torch.randn_like(v) for k, v in real.items()}

    got = outer_gradient(_late(real, waits), base, residual)
    assert waits[0] == 1
    want = outer_gradient(real, base, residual)
    assert all(torch.equal(got[k], want[k]) for k in want)

    new = {k: torch.randn_like(v) for k, v in real.items()}
    local = {k: v + 0.5 for k, v in real.items()}
    got = receive_rule(local, new, _late(real, waits), alpha=0.3, keep_progress=True)
    want = receive_rule(local, new, real, alpha=0.3, keep_progress=True)
    assert waits[0] == 2 and all(torch.equal(got[k], want[k]) for k in want)

    done = _late(real, waits)
    landed(done)
    landed(done)  # once landed, no second wait
    assert waits[0] == 3 and done.event is None


def test_the_receivers_increment_waits_for_the_copy_it_subtracts():
    """A version merged from other learners' contributions can come in before this learner's
    upload has computed (and so waited for) its gradient: the receiver waits itself."""
    store = open_store(f"memory://late-{uuid.uuid4().hex}")
    init_run(store, RunSpec(task=TINY, num_fragments=2, sync_every=4, overlap_steps=1, codec="none", total_steps=0,
                            warmup_steps=0, batch_size=4))
    with DiLoCoSync(store, load_task(TINY).build_model(), learner_id="r",
                    options=SyncOptions(threads=False, handle_sigterm=False, align_schedule=False)) as sync:
        readers = {p: FragmentReader(store, run_id=sync.run_id, plan=sync.plan, fragment=p) for p in sync.readers}
        theta = {k: v + 0.25 for k, v in sync.base[0][1].items()}
    waits = [0]
    receiver = Receiver(store, readers, learner_id="r", min_poll_s=0.0, stats=LearnerStats())
    receiver.want(0, (-1, {}), subtract=_late(theta, waits))
    receiver.tick()
    ready = receiver.take(0)
    assert ready is not None and waits[0] == 1
    want = difference(ready.value, theta)
    assert all(torch.equal(ready.increment[k], want[k]) for k in want)
    assert all(torch.allclose(want[k], torch.full_like(want[k], -0.25), atol=1e-5) for k in want)  # version 0 - theta


def test_a_run_whose_sends_land_late_is_the_same_run_to_the_bit(monkeypatch):
    """The whole learner (send, deferred gradient, in-place receive, receive rule) against the
    real syncer in the deterministic simulation: with every send's copy landing only when waited
    for, the run is bit for bit the one with copies made at once, and the copies were waited for."""
    from ddiloco_cli.simtrain import simulate_train
    from ddiloco_cli.simtrain.scenario import Scenario

    sc = Scenario(learners=2, steps_per_learner=32, step_s=0.5, eval_points=1, eval_batches=2, arms=("decoupled",),
                  run={"sync_every": 8, "overlap_steps": 4, "num_fragments": 2})
    plain = simulate_train(sc)["decoupled"]

    waits, sends = [0], [0]
    real_gather = island_mod.gather_fragment

    def late_gather(plan, p, params, *, non_blocking=False):
        out = real_gather(plan, p, params, non_blocking=non_blocking)
        if not non_blocking:
            return out
        sends[0] += 1
        return _late(dict(out), waits)

    monkeypatch.setattr(island_mod, "gather_fragment", late_gather)
    late = simulate_train(sc)["decoupled"]
    assert sends[0] > 0 and waits[0] == sends[0]
    assert late["ledger"]["refused"] == 0 and late["ledger"]["used"] == plain["ledger"]["used"] > 0
    assert late["val_loss"] == plain["val_loss"]
