"""With M=1, K=1, P=1, tau=0, alpha=0 and codec none, `--mode lockstep` is classic
DiLoCo (inner AdamW, outer Nesterov SGD): the learner must reproduce a plain
reference loop bit for bit."""

from __future__ import annotations

import threading
import uuid

import torch

from ddiloco_cli.learner import Learner, LearnerOptions, lr_at
from ddiloco_cli.runinit import RunSpec, init_run
from ddiloco_cli.store import open_store
from ddiloco_cli.syncer import Syncer, SyncerOptions
from ddiloco_cli.tasks import load_task

H, ROUNDS = 4, 3
SPEC = dict(task="ddiloco_cli.tasks.gpt:tiny", num_fragments=1, sync_every=H, overlap_steps=0, quorum=1, alpha=0.0,
            codec="none", mode="lockstep", outer_lr=0.7, outer_momentum=0.9, inner_lr=3e-3, warmup_steps=2,
            lr_schedule="cosine", total_steps=H * ROUNDS, grad_clip=1.0, batch_size=8, seed=3,
            heartbeat_s=0.2, lease_s=5.0)


def reference_diloco() -> dict[str, torch.Tensor]:
    task = load_task(SPEC["task"])
    torch.manual_seed(SPEC["seed"])
    model = task.build_model()
    params = dict(model.named_parameters())
    global_params = {k: v.detach().clone() for k, v in params.items()}
    inner = dict(lr=SPEC["inner_lr"], betas=[0.9, 0.95], weight_decay=0.1, warmup_steps=SPEC["warmup_steps"],
                 lr_schedule=SPEC["lr_schedule"], total_steps=SPEC["total_steps"], grad_clip=1.0, batch_size=8)
    opt = torch.optim.AdamW(params.values(), lr=inner["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    outer = torch.optim.SGD(global_params.values(), lr=SPEC["outer_lr"], momentum=SPEC["outer_momentum"], nesterov=True)
    batches = task.batches(shard=0, num_shards=1, seed=SPEC["seed"], batch_size=8)
    for step in range(H * ROUNDS):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, inner)
        loss = task.loss(model, next(batches))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % H == 0:  # outer step: outer gradient = global - local, then overwrite local
            with torch.no_grad():
                for k, g in global_params.items():
                    g.grad = g - params[k].detach()
                outer.step()
                for k, p in params.items():
                    p.copy_(global_params[k])
    return {k: v.detach().clone() for k, v in params.items()}


def test_lockstep_m1_reproduces_classic_diloco_bit_for_bit():
    store = open_store(f"memory://diloco-{uuid.uuid4().hex}")
    init_run(store, RunSpec(**SPEC))
    stop = threading.Event()
    syncer = Syncer(store, options=SyncerOptions(poll_s=0.005, gc=False))
    thread = threading.Thread(target=syncer.serve, kwargs={"stop": stop.is_set}, daemon=True)
    thread.start()
    try:
        learner = Learner(store, options=LearnerOptions(learner_id="solo", shard=0, num_shards=1, poll_s=0.005))
        assert learner.train() == "finished"
    finally:
        stop.set()
        thread.join(timeout=30)
    got = dict(learner.model.named_parameters())
    want = reference_diloco()
    assert syncer.states[0].version == ROUNDS
    for name, w in want.items():
        assert torch.equal(got[name].detach(), w), f"{name} differs from the reference DiLoCo loop"
