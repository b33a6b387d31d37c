"""The syncer's intake decodes contributions in a thread pool with the same outcome as
one by one; the delta norm taken at intake; the heap setting the syncer makes."""

from __future__ import annotations

import math
import platform
import uuid

import pytest
import torch

from ddiloco_cli import heap
from ddiloco_cli.protocol import layout, records
from ddiloco_cli.store import open_store
from ddiloco_cli.syncer.intake import delta_norm

from support.runs import beat, contribution, live_syncer, make_run


def _bucket():
    """A run with int4 contributions, good and bad, from three learners (and one unknown)."""
    store = open_store(f"memory://intake-{uuid.uuid4().hex}")
    make_run(store, codec="int4", publish_codec="int4")
    for lid in ("a", "b", "c"):
        beat(store, lid)
    for seq in (1, 2, 3):
        contribution(store, 0, "a", seq, codec_name="int4")
    contribution(store, 0, "b", 1, codec_name="int4")
    store.put_if_absent(layout.contribution_key(0, "b", 2), b"not a payload")  # does not decode
    contribution(store, 0, "c", 1, codec_name="none")  # not the run's codec
    contribution(store, 0, "c", 2, codec_name="int4", header={"run_id": "another-run"})
    contribution(store, 0, "d", 1, codec_name="int4")  # no heartbeat: unknown learner
    contribution(store, 1, "a", 1, codec_name="int4")  # another fragment
    return store


def _take(decode_threads: int):
    """What one poll takes: (quarantined keys in order, pending contributions, closed entries)."""
    s = live_syncer(_bucket())
    s.intake.decode_threads = decode_threads
    quarantined = []
    report = s.intake.quarantine
    s.intake.quarantine = lambda key, reason, **kw: (quarantined.append((key, reason.split(": ", 1)[1])),
                                                        report(key, reason, **kw))
    s.poll_contributions()
    for st in s.states.values():  # the bytes' own hash (each bucket has its own run id in the headers)
        assert all(c.sha256 == records.sha256_hex(s.store.get(c.key)) for cs in st.pending.values() for c in cs)
    pending = {p: {lid: [(c.seq, c.key, c.norm, c.delta) for c in cs] for lid, cs in st.pending.items()}
               for p, st in s.states.items()}
    closed = {p: [(e.learner_id, e.seq, e.status) for e in st.closed] for p, st in s.states.items()}
    return s, quarantined, pending, closed


def test_pool_decode_takes_and_quarantines_exactly_as_one_by_one():
    serial, q1, pending1, closed1 = _take(1)
    pooled, q4, pending4, closed4 = _take(4)
    assert serial.intake._pool is None and pooled.intake._pool is not None  # the pool did the decoding
    assert q4 == q1
    assert [key for key, _ in q1] == [layout.contribution_key(0, lid, seq) for lid, seq in
                                      (("c", 1), ("b", 2), ("c", 2), ("d", 1))]  # known learners first, in seq order
    assert "codec 'none'" in q1[0][1] and "unknown learner" in q1[3][1] and "another-run" in q1[2][1]
    assert closed4 == closed1 and closed1[0] == [("a", 1, "superseded"), ("a", 2, "superseded")]
    assert pending4.keys() == pending1.keys()
    for p in pending1:
        assert pending4[p].keys() == pending1[p].keys()
        for lid in pending1[p]:
            for (seq1, key1, norm1, delta1), (seq4, key4, norm4, delta4) in zip(pending1[p][lid], pending4[p][lid]):
                assert (seq4, key4, norm4) == (seq1, key1, norm1)
                assert all(torch.equal(delta4[k], delta1[k]) for k in delta1)
    assert sorted(pending1[0]) == ["a", "b"] and [c[0] for c in pending1[0]["a"]] == [3]


def test_a_contribution_gone_before_its_download_is_skipped():
    store = _bucket()
    s = live_syncer(store)
    s.intake.decode_threads = 4
    infos = s.intake.list_new([0])[0]
    store.delete(layout.contribution_key(0, "a", 2))
    items = [(i, *layout.parse_contribution_key(i.key)[1:]) for i in infos]
    got = list(s.intake.load_all(0, items))
    assert [c is None for c in got] == [i.key in {layout.contribution_key(0, "a", 2), layout.contribution_key(0, "b", 2),
                                                  layout.contribution_key(0, "c", 1), layout.contribution_key(0, "c", 2),
                                                  layout.contribution_key(0, "d", 1)} for i in infos]
    assert layout.contribution_key(0, "a", 2) not in s.bad_keys  # gone is not bad


def test_delta_norm_is_the_l2_norm_of_every_tensor_even_past_fp32_squares():
    g = torch.Generator().manual_seed(0)
    delta = {"w": torch.randn(300, 7, generator=g), "b": torch.randn(7, generator=g), "s": torch.tensor(2.0)}
    exact = math.sqrt(sum(float(t.double().pow(2).sum()) for t in delta.values()))
    assert delta_norm(delta) == pytest.approx(exact, rel=1e-6)
    assert delta_norm({"w": torch.full((4,), 1e30), "b": torch.ones(1)}) == pytest.approx(2e30, rel=1e-6)
    assert delta_norm({"w": torch.zeros(3)}) == 0.0


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_heap_setting_takes_effect_once():
    assert heap.keep_freed_memory() is True
    assert heap.keep_freed_memory() is True  # idempotent: the syncer calls it on every start
