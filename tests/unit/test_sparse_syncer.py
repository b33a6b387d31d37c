"""The syncer with sparse contributions: merged on the union of their supports (mean and RDA),
sparse published deltas every learner applies bit for bit, plain descent (outer momentum 0),
a replay that reproduces the commits, and intake refusing a contribution denser than the run."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from ddiloco_cli.numerics import codec
from ddiloco_cli.numerics.merge import merge_outer_gradients
from ddiloco_cli.protocol import layout, ledger, records
from ddiloco_cli.store import open_store

from support.runs import assert_same_state, beat, contribution, delta_for, drive, live_syncer, make_run, restored, step


def _sparse(tensors: dict[str, torch.Tensor], density: float = 0.05):
    data = codec.encode_tensors(tensors, codec="sparse", block_size=256, density=density)
    return codec.decode_tensors(data, max_numel=1 << 20, keep_codes=True)[0]


@pytest.mark.parametrize("method", ["mean", "rda"])
def test_sparse_contributions_merge_like_their_dense_values_on_the_union_of_supports(method):
    g = torch.Generator().manual_seed(0)
    grads = [_sparse({"w": torch.randn(40, 50, generator=g), "b": torch.randn(50, generator=g)}) for _ in range(3)]
    weights = [1.0, 2.0, 0.5]
    got = merge_outer_gradients(grads, weights, method=method)
    want = merge_outer_gradients([{k: v.clone() for k, v in gr.items()} for gr in grads], weights, method=method)
    union = torch.zeros(2000, dtype=torch.bool)
    for gr in grads:
        union |= gr["w"].reshape(-1) != 0
    for k in got:
        assert torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-7), k
    assert bool((got["w"].reshape(-1)[~union] == 0).all()) and int(union.sum()) < 2000 * 0.16
    again = merge_outer_gradients(grads[::-1], weights[::-1], method=method)
    assert all(torch.equal(got[k], again[k]) for k in got)  # the canonical order: bit for bit


def test_a_merge_of_sparse_contributions_adds_each_sent_value_once_in_the_canonical_order():
    # over several of the merge's ranges (65536 values each): the whole-vector sum gives every
    # value the operations the range-by-range sum gives it, bit for bit
    g = torch.Generator().manual_seed(1)
    n = 3 * 65536 + 1000
    grads = [_sparse({"w": torch.randn(n, generator=g) * 10.0 ** (i - 2)}, density=0.3) for i in range(5)]
    weights = [3.0, 1.0, 2.5, 0.5, 4.0]
    got = merge_outer_gradients(grads, weights, method="mean")["w"]
    want = np.zeros(n, dtype=np.float32)
    total = sum(weights)
    for first, i in enumerate(sorted(range(5), key=lambda i: weights[i])):  # the canonical order: by weight
        st = grads[i].sources["w"]
        term = st.value * np.float32(weights[i] / total)
        if first == 0:
            want[st.index] = term
        else:
            want[st.index] = want[st.index] + term
    assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32))


def _sparse_run(learners=("a", "b"), **overrides):
    store = open_store(f"memory://sparse-{uuid.uuid4().hex}")
    make_run(store, **{"codec": "sparse", "publish_codec": "sparse", **overrides})
    for lid in learners:
        beat(store, lid)
    return store


def test_a_sparse_run_publishes_sparse_deltas_that_learners_apply_bit_for_bit():
    store = _sparse_run(learners=("a",), outer_momentum=0.0, outer_lr=1.0)
    s = live_syncer(store)
    before = {k: v.clone() for k, v in s.states[0].value.items()}
    _, _, sent = contribution(store, 0, "a", 1, codec_name="sparse")
    assert step(s, 0) and s.states[0].version == 1
    m = ledger.read_manifest(store, 0, 1)
    delta = next(e for e in m["payloads"] if e["kind"] == "delta")
    assert delta["codec"] == "sparse"
    applied = codec.apply_published_delta(before, store.get(delta["key"]), where="v1")
    assert all(torch.equal(applied[k], s.states[0].value[k]) for k in applied)
    # plain descent with lr 1 and one learner: the fragment moves by minus its sent values, which the
    # published delta carries up to its own Top-k (the rest stays in the syncer's raw value)
    decoded, _ = codec.decode_tensors(store.get(layout.contribution_key(0, "a", 1)), max_numel=1 << 20)
    for k, t in s.states[0].current.raw.items():
        assert torch.allclose(t, before[k] - decoded[k], atol=1e-6), k


def test_a_sparse_run_replays_to_the_same_state():
    store = _sparse_run()

    def sparse_contribution(store, p, lid, seq, **kw):
        return contribution(store, p, lid, seq, codec_name="sparse", **kw)

    import support.runs as runs
    plain = runs.contribution
    runs.contribution = sparse_contribution
    try:
        s = live_syncer(store)
        drive(store, s, rounds=3)
    finally:
        runs.contribution = plain
    assert_same_state(s, restored(store))


def test_intake_refuses_a_contribution_denser_than_the_run():
    store = _sparse_run()
    s = live_syncer(store)
    quarantined = []
    s.intake.quarantine = lambda key, reason, **kw: quarantined.append((key, reason))
    run = ledger.read_run(store)
    assert run["codec_density"] == 0.02 and run["error_feedback_decay"] == 0.9
    meta = records.make("contribution", run_id=run["run_id"], fragment=0, learner_id="b", seq=1, base_version=0,
                        c_tokens=64, c_steps=2, step=1, nonce="n", created_s=0.0)
    for density, block, seq in ((0.5, None, 1), (0.02, 2048, 2)):
        data = codec.encode_tensors(delta_for(store, 0, seq), codec="sparse", density=density, block_size=block,
                                    metadata={**meta, "seq": seq})
        assert store.put_if_absent(layout.contribution_key(0, "b", seq), data)
    contribution(store, 0, "a", 1, codec_name="sparse")
    s.poll_contributions()
    reasons = [r for _, r in quarantined]
    assert len(reasons) == 2, reasons
    assert "topk 512, but the run's is 20" in reasons[0] and "block size 2048, but the run's is 1024" in reasons[1]


def test_a_sparse_contribution_on_an_older_base_is_its_sent_values_M6():
    """[M6]: a dense contribution on an older base is measured against the current value,
    (current - base) + delta; a sparse one is its sent values whatever its base. Measured against
    the current value, its unsent coordinates (zeros: no information) would pull the fragment
    back to the stale base, which made a sparse run with versions a cycle late diverge."""
    from ddiloco_cli.numerics.sparse import SparseTensor
    from ddiloco_cli.syncer.update import contribution_gradient

    base, current = {"w": torch.zeros(8)}, {"w": torch.full((8,), 2.0)}
    sparse = {"w": SparseTensor(shape=(8,), index=np.array([1, 5]), value=np.array([0.5, -1.0], dtype=np.float32))}
    assert contribution_gradient(sparse, base=base, current=current)["w"] is sparse["w"]
    dense = {"w": torch.ones(8)}
    assert torch.equal(contribution_gradient(dense, base=base, current=current)["w"], torch.full((8,), 3.0))
    assert contribution_gradient(dense)["w"] is dense["w"]  # on the current base: the delta, bit for bit
