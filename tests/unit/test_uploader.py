"""The learner's upload queue: several workers, newest contribution of a fragment wins
in decoupled mode, nothing replaced in lock-step."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

from ddiloco_cli.learner import LearnerStats, Uploader
from ddiloco_cli.numerics import codec
from ddiloco_cli.store import open_store


def _item(fragment: int, seq: int, base_version: int = 0) -> tuple[str, dict, dict]:
    key = f"contributions/p{fragment:05d}/a/{seq:020d}.safetensors"
    return key, {"w": torch.full((4,), float(seq))}, {"fragment": fragment, "seq": seq, "base_version": base_version}


@pytest.mark.parametrize("newest_wins", [True, False])
def test_newest_contribution_of_a_fragment_replaces_a_queued_one(newest_wins):
    store = open_store(f"memory://up-{uuid.uuid4().hex}")
    stats = LearnerStats()
    up = Uploader(store, codec_name="none", block_size=64, maxsize=8, stats=stats, num_workers=3,
                  newest_wins=newest_wins)
    for fragment, seq in [(0, 1), (1, 2), (0, 3), (2, 4), (0, 5)]:  # queued before any worker runs
        assert up.submit(*_item(fragment, seq)) < 1.0
    up.start()
    up.close()
    keys = sorted(i.key for i in store.list("contributions/"))
    seqs = sorted(int(k.rsplit("/", 1)[1].split(".")[0]) for k in keys)
    if newest_wins:
        assert seqs == [2, 4, 5] and up.replaced == 2
        tensors, meta = codec.decode_tensors(store.get(_item(0, 5)[0]), max_numel=4)
        assert meta == {"fragment": 0, "seq": 5, "base_version": 0} and torch.equal(tensors["w"], torch.full((4,), 5.0))
    else:
        assert seqs == [1, 2, 3, 4, 5] and up.replaced == 0
    assert stats.num_contributions == len(seqs)
    assert stats.bytes_up == sum(i.size for i in store.list("contributions/"))


def test_a_contribution_on_a_new_base_does_not_replace_one_on_the_old_base():
    """Across a re-base the newer delta no longer carries the older one's steps: both go up."""
    store = open_store(f"memory://up-{uuid.uuid4().hex}")
    up = Uploader(store, codec_name="none", block_size=64, maxsize=8, stats=LearnerStats(), num_workers=1)
    for seq, base in [(1, 0), (2, 0), (3, 1), (4, 1)]:  # fragment 0: seq 2 replaces 1, seq 4 replaces 3
        up.submit(*_item(0, seq, base))
    up.start()
    up.close()
    seqs = sorted(int(i.key.rsplit("/", 1)[1].split(".")[0]) for i in store.list("contributions/"))
    assert seqs == [2, 4] and up.replaced == 2


class _GatedStore:
    """A store whose create of one key waits for a gate; records when each create starts and ends."""

    def __init__(self, store, gated_key: str):
        self.store, self.gated_key = store, gated_key
        self.gate, self.events, self.lock = threading.Event(), [], threading.Lock()
        self.other_landed = threading.Event()

    def put_if_absent(self, key: str, data: bytes) -> bool:
        with self.lock:
            self.events.append(("start", key))
        if key == self.gated_key:
            assert self.gate.wait(timeout=120), "the test never opened the gate"
        created = self.store.put_if_absent(key, data)
        with self.lock:
            self.events.append(("end", key))
        if key != self.gated_key:
            self.other_landed.set()
        return created

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_one_fragments_contributions_land_in_seq_order_while_other_fragments_go_on():
    """Across a re-base both contributions go up; the later one must not be created before the
    earlier one (the syncer takes no seq at or below its learner's high-water mark, so a later
    one merged first would leave the earlier one out of the ledger). Another fragment's
    contribution uploads meanwhile."""
    first, second, other = _item(0, 1, 0), _item(0, 2, 1), _item(1, 3, 0)
    store = _GatedStore(open_store(f"memory://up-{uuid.uuid4().hex}"), gated_key=first[0])
    up = Uploader(store, codec_name="none", block_size=64, maxsize=8, stats=LearnerStats(), num_workers=3)
    for item in (first, second, other):
        up.submit(*item)
    up.start()
    assert store.other_landed.wait(timeout=120), "fragment 1's contribution waited behind fragment 0's"
    with store.lock:
        assert ("start", second[0]) not in store.events, "fragment 0's seq 2 started before seq 1 was created"
    store.gate.set()
    up.close()
    order = [key for what, key in store.events if what == "end" and key != other[0]]
    assert order == [first[0], second[0]]
    assert up.stats.uploads_failed == 0 and up.queue.empty() and not up.queue.busy


def test_a_contribution_that_cannot_be_encoded_is_counted_and_frees_its_fragment():
    """A failure of one contribution neither kills the worker nor holds the fragment's next one."""
    store = open_store(f"memory://up-{uuid.uuid4().hex}")
    up = Uploader(store, codec_name="none", block_size=64, maxsize=8, stats=LearnerStats(), num_workers=1)
    key, _, header = _item(0, 1, 0)
    up.submit(key, {"w": "not a tensor"}, header)
    up.submit(*_item(0, 2, 1))
    up.start()
    up.close()
    assert up.stats.uploads_failed == 1
    assert [i.key for i in store.list("contributions/")] == [_item(0, 2, 1)[0]]
