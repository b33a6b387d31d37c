"""The training thread only copies a fragment out at a send; the upload thread computes the
outer gradient when it encodes the contribution (sendpath.PendingDelta). A version received in
between must not change the base that gradient is measured against."""

from __future__ import annotations

import uuid

import torch

from ddiloco_cli import DiLoCoSync, SyncOptions
from ddiloco_cli.learner.sendpath import PendingDelta, outer_gradient
from ddiloco_cli.ops.runinit import RunSpec, init_run
from ddiloco_cli.store import open_store
from ddiloco_cli.tasks import load_task

TINY = "ddiloco_cli.tasks.gpt:tiny"


def _sync(codec: str = "int4") -> DiLoCoSync:
    store = open_store(f"memory://deferred-{uuid.uuid4().hex}")
    init_run(store, RunSpec(task=TINY, num_fragments=2, sync_every=4, overlap_steps=1, codec=codec, total_steps=0,
                            warmup_steps=0, batch_size=4))
    # no worker threads: the test is the driver, so an upload waits in the queue as long as it likes
    return DiLoCoSync(store, load_task(TINY).build_model(), learner_id="d",
                      options=SyncOptions(threads=False, handle_sigterm=False, align_schedule=False))


def _train_a_little(sync: DiLoCoSync) -> None:
    with torch.no_grad():
        for t in sync.params.values():
            t.add_(0.01 * torch.randn_like(t))


def test_a_receive_before_the_upload_computes_its_gradient_leaves_that_gradients_base_alone():
    with _sync() as sync:
        sent = []
        while not sent:
            _train_a_little(sync)
            sync.step(num_tokens=1)
            sent = [p for p in sync.in_flight]
        p = sent[0]
        key, delta, header = sync._uploader.take_next()
        assert isinstance(delta, PendingDelta) and not delta.done and sync._lent(p)
        base_tensors = sync.base[p][1]
        old_base = {k: v.clone() for k, v in base_tensors.items()}
        newer = {k: v + 1.0 for k, v in old_base.items()}
        sync._rebase(p, 7, newer)  # a version taken while the upload waits
        assert sync.base[p] == (7, newer) and sync.base[p][1] is not base_tensors
        assert all(torch.equal(base_tensors[k], old_base[k]) for k in old_base)  # not written over
        theta = delta.theta
        got = delta.materialize()
        assert delta.done and not sync._lent(p)
        assert delta.theta is None and delta.base is None  # let go: the fragment's theta lives as long as its receive
        want = outer_gradient(theta, old_base, sync._residual.get(p))
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert int(header["base_version"]) == 0  # the version the gradient is measured against
        sync._uploader.finish(key, header, *sync._uploader.encode(key, got, header))
        # with nothing pending, a receive copies into the base's tensors again (one set a session)
        kept = sync.base[p][1]
        sync._rebase(p, 8, {k: v + 2.0 for k, v in old_base.items()})
        assert sync.base[p][1] is kept and all(torch.equal(kept[k], old_base[k] + 2.0) for k in kept)


def test_the_deferred_gradient_carries_the_residual_of_the_last_upload_of_its_fragment():
    """Error feedback [L6]: a contribution's gradient adds what the codec left out of the previous
    contribution of its fragment, as the upload thread finds it when it computes the gradient."""
    with _sync() as sync:
        for _ in range(3 * sync.H):
            _train_a_little(sync)
            sync.step(num_tokens=1)
            while (item := sync._uploader.take_next()) is not None:
                key, delta, header = item
                p = int(header["fragment"])
                residual = sync._residual.get(p)
                residual = None if residual is None else {k: v.clone() for k, v in residual.items()}
                theta, base = delta.theta, {k: v.clone() for k, v in delta.base.items()}
                got = delta.materialize()
                want = outer_gradient(theta, base, residual)
                assert all(torch.equal(got[k], want[k]) for k in want)
                sync._uploader.finish(key, header, *sync._uploader.encode(key, got, header))
        assert sync._residual, "no residual was kept: error feedback did not run"
