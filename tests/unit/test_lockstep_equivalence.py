"""With M=1, K=1, P=1, tau=0, alpha=0 and codec none, `--mode lockstep` is classic
DiLoCo (inner AdamW, outer Nesterov SGD): the learner must reproduce a plain
reference loop bit for bit. With M=2 and P=2 it is Streaming DiLoCo, again bit for bit."""

from __future__ import annotations

import copy
import threading
import uuid

import torch

from ddiloco_cli.learner import Learner, LearnerOptions, SyncOptions, lr_at
from ddiloco_cli.learner.schedule import fragments_due
from ddiloco_cli.ops.runinit import RunSpec, init_run
from ddiloco_cli.protocol import ledger
from ddiloco_cli.protocol.fragments import gather_fragment, scatter_fragment
from ddiloco_cli.store import open_store
from ddiloco_cli.syncer.core import Syncer, SyncerOptions
from ddiloco_cli.tasks import load_task

H, ROUNDS = 4, 3
SPEC = dict(task="ddiloco_cli.tasks.gpt:tiny", num_fragments=1, sync_every=H, overlap_steps=0, quorum=1, alpha=0.0,
            codec="none", mode="lockstep", outer_lr=0.7, outer_momentum=0.9, inner_lr=3e-3, warmup_steps=2,
            lr_schedule="cosine", total_steps=H * ROUNDS, grad_clip=1.0, batch_size=8, seed=3,
            heartbeat_s=0.2, lease_s=5.0)


def inner_step(task, model, opt, batch, *, lr: float) -> None:
    """One plain AdamW step of the reference loops, as the learner takes it (clip 1.0)."""
    for group in opt.param_groups:
        group["lr"] = lr
    loss = task.loss(model, batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


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
        inner_step(task, model, opt, next(batches), lr=lr_at(step, inner))
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
        learner = Learner(store, options=LearnerOptions(learner_id="solo", shard=0, num_shards=1,
                                                        sync=SyncOptions(min_poll_s=0.005)))
        assert learner.train() == "finished"
    finally:
        stop.set()
        thread.join(timeout=30)
    got = dict(learner.model.named_parameters())
    want = reference_diloco()
    assert syncer.states[0].version == ROUNDS
    for name, w in want.items():
        assert torch.equal(got[name].detach(), w), f"{name} differs from the reference DiLoCo loop"


def reference_streaming_diloco(plan, *, num_learners: int, spec: dict) -> list[dict[str, torch.Tensor]]:
    """Streaming DiLoCo in plain PyTorch: M replicas (AdamW on data shard m of M); after inner
    step s every fragment p due at s (ddiloco's offsets, fragments_due) takes one outer Nesterov
    step (torch.optim.SGD on that fragment's slices) with the mean of the replicas' outer
    gradients (global - local), and every replica overwrites p with the new global value."""
    task = load_task(spec["task"])
    torch.manual_seed(spec["seed"])
    init = task.build_model()
    models = [copy.deepcopy(init) for _ in range(num_learners)]
    inner = dict(lr=spec["inner_lr"], betas=[0.9, 0.95], weight_decay=0.1, warmup_steps=spec["warmup_steps"],
                 lr_schedule=spec["lr_schedule"], total_steps=spec["total_steps"], grad_clip=1.0, batch_size=8)
    opts = [torch.optim.AdamW(m.parameters(), lr=inner["lr"], betas=(0.9, 0.95), weight_decay=0.1) for m in models]
    batches = [task.batches(shard=m, num_shards=num_learners, seed=spec["seed"], batch_size=8)
               for m in range(num_learners)]
    P = spec["num_fragments"]
    init_params = {k: v.detach() for k, v in init.named_parameters()}
    global_frags = [{k: v.clone().requires_grad_(True) for k, v in gather_fragment(plan, p, init_params).items()}
                    for p in range(P)]
    outers = [torch.optim.SGD(global_frags[p].values(), lr=spec["outer_lr"], momentum=spec["outer_momentum"],
                              nesterov=True) for p in range(P)]
    for step in range(spec["total_steps"]):
        for model, opt, data in zip(models, opts, batches):
            inner_step(task, model, opt, next(data), lr=lr_at(step, inner))
        for p in fragments_due(step + 1, num_fragments=P, sync_every=spec["sync_every"]):
            locals_ = [gather_fragment(plan, p, dict(m.named_parameters())) for m in models]
            with torch.no_grad():
                for k, g in global_frags[p].items():
                    grads = [g.detach() - loc[k] for loc in locals_]
                    g.grad = grads[0] * 0.5 + grads[1] * 0.5  # the mean of two
                outers[p].step()
                for m in models:
                    scatter_fragment(plan, p, dict(m.named_parameters()),
                                     {k: v.detach() for k, v in global_frags[p].items()})
    return [{k: v.detach().clone() for k, v in m.named_parameters()} for m in models]


def test_lockstep_m2_p2_is_streaming_diloco_bit_for_bit():
    """M = 2 learners, P = 2 fragments, lock-step (K = M, mean merge, overwrite): both learners
    end bit-identical to a plain-PyTorch Streaming DiLoCo loop."""
    spec = {**SPEC, "num_fragments": 2, "quorum": 2}
    store = open_store(f"memory://streaming-{uuid.uuid4().hex}")
    run = init_run(store, RunSpec(**spec))
    plan = ledger.read_plan(store, run_id=run["run_id"])
    stop = threading.Event()
    syncer = Syncer(store, options=SyncerOptions(poll_s=0.005, gc=False))
    thread = threading.Thread(target=syncer.serve, kwargs={"stop": stop.is_set}, daemon=True)
    thread.start()
    learners = [Learner(store, options=LearnerOptions(learner_id=f"l{m}", shard=m, num_shards=2,
                                                      sync=SyncOptions(min_poll_s=0.005)))
                for m in range(2)]
    results: dict[int, str] = {}
    threads = [threading.Thread(target=lambda m=m: results.__setitem__(m, learners[m].train()), daemon=True)
               for m in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert results == {0: "finished", 1: "finished"}
    want = reference_streaming_diloco(plan, num_learners=2, spec=spec)
    assert all(s.version == ROUNDS for s in syncer.states.values())
    for m, learner in enumerate(learners):
        got = dict(learner.model.named_parameters())
        for name, w in want[m].items():
            assert torch.equal(got[name].detach(), w), f"learner {m}: {name} differs from Streaming DiLoCo"
