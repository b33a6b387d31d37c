"""The learner's side of a sparse run: the decayed error-feedback accumulator
(e <- beta * e + delta; send Q(TopK(e)); e <- e - sent), per fragment in fp32, kept across
sends, and zero again in a new session (docs/sparse.md)."""

from __future__ import annotations

import time
import uuid

import torch

from ddiloco_cli import DiLoCoSync
from ddiloco_cli.numerics import codec
from ddiloco_cli.ops.runinit import RunSpec, init_run
from ddiloco_cli.protocol import layout, ledger
from ddiloco_cli.store import open_store
from ddiloco_cli.tasks import load_task

TINY = "ddiloco_cli.tasks.gpt:tiny"


def _run(**spec):
    store = open_store(f"memory://sparse-learner-{uuid.uuid4().hex}")
    init_run(store, RunSpec(**{"task": TINY, "num_fragments": 1, "sync_every": 2, "overlap_steps": 0,
                               "codec": "sparse", "codec_block": 256, "codec_density": 0.05, "total_steps": 0,
                               "warmup_steps": 0, "batch_size": 4, **spec}))
    return store


def _contributions(store, model, learner_id: str, rounds: int) -> tuple[dict, list[dict], list[dict]]:
    """Send ``rounds`` contributions of fragment 0 (random moves stand in for training); returns
    (the base, the thetas sent, the decoded contributions)."""
    with DiLoCoSync(store, model, learner_id=learner_id) as sync:
        base = {k: v.clone() for k, v in sync.base[0][1].items()}
        thetas = []
        for i in range(rounds):
            with torch.no_grad():
                for t in model.parameters():
                    t.add_(torch.randn_like(t) * 0.01)
            thetas.append({s.key: s.view_of(dict(model.named_parameters())[s.name]).float().clone()
                           for s in sync.plan.fragments[0]})
            sync.step(num_tokens=1)
            sync.step(num_tokens=1)  # fragment 0 is due every 2 steps
            while sync.stats.num_contributions < i + 1:  # uploaded, its residual kept, before the next send
                time.sleep(0.01)
    infos = sorted(store.list(layout.contribution_prefix(0) + learner_id + "/"), key=lambda i: i.key)
    got = [codec.decode_tensors(store.get(i.key), max_numel=10**7)[0] for i in infos]
    return base, thetas, got


def _sent(x: dict, run: dict) -> tuple[dict, dict]:
    """(decoded, residual) of x as the run's learners encode it."""
    data, residual = codec.encode_with_residual(x, codec="sparse", block_size=run["codec_block"],
                                                density=run["codec_density"])
    return codec.decode_tensors(data, max_numel=10**7)[0], residual


def test_the_accumulator_decays_and_keeps_what_was_not_sent():
    store = _run(error_feedback_decay=0.5)
    torch.manual_seed(0)
    model = load_task(TINY).build_model()
    base, thetas, got = _contributions(store, model, "e", 3)
    run = ledger.read_run(store)
    assert run["error_feedback_decay"] == 0.5 and len(got) == 3
    e = {k: torch.zeros_like(v) for k, v in base.items()}
    for theta, contribution in zip(thetas, got):
        delta = {k: base[k] - theta[k] for k in base}  # the whole progress on the (unchanged) base
        e = {k: delta[k] + 0.5 * e[k] for k in base}
        sent, e = _sent(e, run)
        assert all(torch.equal(contribution[k], sent[k]) for k in base)
        numel = sum(t.numel() for t in sent.values())
        assert 0 < sum(int((t != 0).sum()) for t in sent.values()) <= 0.08 * numel  # sparse


def test_each_fragment_keeps_its_residual_in_one_buffer_for_the_session():
    """The upload thread copies a new residual into the fragment's first one (a new block a send,
    freed H steps later among the thread's short-lived ones, fragmented its heap); the values are
    the newest residual's (the test above checks what they add to the next contribution)."""
    store = _run(error_feedback_decay=0.5)
    torch.manual_seed(2)
    model = load_task(TINY).build_model()
    with DiLoCoSync(store, model, learner_id="b") as sync:
        buffers = []
        for i in range(3):
            with torch.no_grad():
                for t in model.parameters():
                    t.add_(torch.randn_like(t) * 0.01)
            sync.step(num_tokens=1)
            sync.step(num_tokens=1)
            while sync.stats.num_contributions < i + 1:
                time.sleep(0.01)
            with sync._residual_lock:
                kept = sync._residual[0]
                buffers.append({k: (v.data_ptr(), v.clone()) for k, v in kept.items()})
    assert [{k: p for k, (p, _) in b.items()} for b in buffers] == [{k: p for k, (p, _) in buffers[0].items()}] * 3
    # the values change from send to send: the buffer holds the newest residual, not the first
    assert any(not torch.equal(buffers[0][k][1], buffers[2][k][1]) for k in buffers[0])


def test_the_default_decay_is_0_9_and_a_new_session_starts_from_zero():
    store = _run()
    run = ledger.read_run(store)
    assert run["error_feedback_decay"] == 0.9
    torch.manual_seed(1)
    model = load_task(TINY).build_model()
    _contributions(store, model, "z", 1)
    base, thetas, got = _contributions(store, model, "z", 1)  # a restart: the accumulator is not persisted
    sent, _ = _sent({k: base[k] - thetas[0][k] for k in base}, run)
    assert all(torch.equal(got[-1][k], sent[k]) for k in base)


def test_a_sparse_run_defaults_to_plain_averaged_descent_and_its_sync_reference_to_nesterov(monkeypatch):
    """SparseLoCo's outer rule by default for sparse uploads (Nesterov on top of the learners'
    accumulators diverged, docs/sparse.md); DiLoCo's for the other codecs; given values win.
    The simulator's classic-DiLoCo reference of a sparse run keeps DiLoCo's Nesterov."""
    from ddiloco_cli.protocol.runconfig import RunConfig
    from ddiloco_cli.simtrain import arms

    sparse, int4 = RunConfig(codec="sparse"), RunConfig(codec="int4")
    assert (sparse.outer_lr, sparse.outer_momentum) == (2.5, 0.0)
    assert (sparse.codec_block, sparse.codec_density, sparse.codec_topk) == (1024, 0.02, 20)
    assert (int4.outer_lr, int4.outer_momentum) == (0.7, 0.9)
    given = RunConfig(codec="sparse", outer_lr=0.5, outer_momentum=0.5)
    assert (given.outer_lr, given.outer_momentum) == (0.5, 0.5)
    seen = []

    class Spy(arms.OuterOptimizer):
        def __init__(self, *, lr, momentum):
            seen.append((lr, momentum))
            raise StopIteration  # the settings are all this test needs

    from ddiloco_cli.simtrain.scenario import Scenario

    monkeypatch.setattr(arms, "OuterOptimizer", Spy)
    for config in (sparse, given, int4):
        try:
            arms.run_sync(load_task("ddiloco_cli.tasks.gpt:tiny"), Scenario(learners=1), config, {})
        except StopIteration:
            pass
    assert seen == [(0.7, 0.9), (0.7, 0.9), (0.7, 0.9)]
