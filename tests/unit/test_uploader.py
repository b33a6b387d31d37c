"""The learner's upload queue: several workers, newest contribution of a fragment wins
in decoupled mode, nothing replaced in lock-step."""

from __future__ import annotations

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
