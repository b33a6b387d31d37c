"""A CUDA learner's copies between the device and the host (run only where torch sees a CUDA
device; CI has none, and the ordering rules are tested without one in test_copy_out.py): a
send's copy into pinned memory is not waited for, holds the values at the send whatever the
device runs after it, and lands for its readers; a receive's increment is pinned, and adding it
gives the bits a blocking copy gives."""

from __future__ import annotations

import uuid

import pytest
import torch

from ddiloco_cli import DiLoCoSync, SyncOptions
from ddiloco_cli.learner.receiver import difference
from ddiloco_cli.learner.sendpath import PendingDelta, outer_gradient
from ddiloco_cli.ops.runinit import RunSpec, init_run
from ddiloco_cli.protocol.fragments import CopyOut, gather_fragment, landed, plan_fragments
from ddiloco_cli.store import open_store
from ddiloco_cli.tasks import load_task

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TINY = "ddiloco_cli.tasks.gpt:tiny"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_send_copy_is_pinned_not_waited_for_and_holds_the_values_at_the_send(dtype):
    params = {"a": torch.randn(512, 256, device="cuda").to(dtype), "b": torch.randn(300, device="cuda").to(dtype)}
    plan = plan_fragments({k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in params.items()}, 1)
    want = gather_fragment(plan, 0, params)
    got = gather_fragment(plan, 0, params, non_blocking=True)
    assert isinstance(got, CopyOut) and got.event is not None
    for t in params.values():  # queued after the copies: must not reach them
        t.mul_(3).add_(1)
    landed(got)
    assert got.event is None
    for k in want:
        assert got[k].is_pinned() and got[k].dtype == torch.float32 and torch.equal(got[k], want[k])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_copy_from_a_device_other_than_the_current_one_waits_on_that_devices_stream():
    assert torch.cuda.current_device() == 0
    params = {"a": torch.randn(1 << 22, device="cuda:1")}
    plan = plan_fragments({"a": ((1 << 22,), "float32")}, 1)
    want = params["a"].cpu()
    got = gather_fragment(plan, 0, params, non_blocking=True)
    params["a"].mul_(3)
    assert torch.equal(landed(got)["a"], want)


def test_a_pinned_increment_has_the_bits_of_a_pageable_one_and_adds_the_same():
    a, b = {"x": torch.randn(4096)}, {"x": torch.randn(4096)}
    pinned, pageable = difference(a, b, pin=True), difference(a, b)
    assert pinned["x"].is_pinned() and torch.equal(pinned["x"], pageable["x"])
    p1 = torch.randn(4096, device="cuda")
    p2 = p1.clone()
    p1.add_(pinned["x"].to("cuda", non_blocking=True), alpha=0.7)
    p2.add_(pageable["x"].to("cuda"), alpha=0.7)
    assert torch.equal(p1, p2)


def test_a_cuda_learners_deferred_gradient_is_the_one_of_its_fragment_at_the_send():
    store = open_store(f"memory://cuda-{uuid.uuid4().hex}")
    init_run(store, RunSpec(task=TINY, num_fragments=2, sync_every=4, overlap_steps=1, codec="int4", total_steps=0,
                            warmup_steps=0, batch_size=4))
    model = load_task(TINY).build_model().cuda()
    with DiLoCoSync(store, model, learner_id="g",
                    options=SyncOptions(threads=False, handle_sigterm=False, align_schedule=False)) as sync:
        assert sync._receiver is None or sync._receiver.pin
        checked = 0
        for _ in range(3 * sync.H):
            with torch.no_grad():
                for t in sync.params.values():
                    t.add_(0.01 * torch.randn_like(t))
            sync.step(num_tokens=1)
            while (item := sync._uploader.take_next()) is not None:
                key, delta, header = item
                assert isinstance(delta, PendingDelta)
                p = int(header["fragment"])
                theta = delta.theta
                assert isinstance(theta, CopyOut)
                base = {k: v.clone() for k, v in delta.base.items()}
                residual = sync._residual.get(p)
                residual = None if residual is None else {k: v.clone() for k, v in residual.items()}
                got = delta.materialize()
                assert theta.event is None  # landed by the gradient
                want = outer_gradient(dict(theta), base, residual)
                assert all(torch.equal(got[k], want[k]) for k in want)
                sync._uploader.finish(key, header, *sync._uploader.encode(key, got, header))
                checked += 1
        assert checked >= 3
