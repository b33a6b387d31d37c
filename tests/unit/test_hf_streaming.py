"""examples/hf_streaming_task.py: a `datasets` stream split by node, resumed from its state."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from support import REPO

pytest.importorskip("datasets")
pytest.importorskip("transformers")

ROOT = str(REPO)


def _example():
    spec = importlib.util.spec_from_file_location("hf_streaming_task", os.path.join(ROOT, "examples", "hf_streaming_task.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def task(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(f"example number {i:04d} of the corpus" for i in range(400)) + "\n")
    return _example().StreamingTextTask(data_files=str(path), seq_len=32)


def _texts(batch) -> set[str]:
    return {bytes(row.tolist()).decode(errors="replace") for row in batch[0]}


def test_nodes_get_disjoint_examples(task):
    a = next(task.batches(shard=0, num_shards=2, seed=0, batch_size=8))
    b = next(task.batches(shard=1, num_shards=2, seed=0, batch_size=8))
    numbers_a = {w for t in _texts(a) for w in t.split() if w.isdigit()}
    numbers_b = {w for t in _texts(b) for w in t.split() if w.isdigit()}
    assert numbers_a and numbers_b and not numbers_a & numbers_b


def test_a_resumed_stream_continues_instead_of_replaying(task):
    stream = task.batches(shard=0, num_shards=2, seed=0, batch_size=4)
    first = [next(stream) for _ in range(3)]
    state = json.loads(json.dumps(stream.state_dict()))  # what the learner stores in the bucket
    expected = [next(stream) for _ in range(2)]
    resumed = task.batches(shard=0, num_shards=2, seed=0, batch_size=4, state=state)
    for want, got in zip(expected, [next(resumed) for _ in range(2)]):
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    assert not torch.equal(first[0][0], expected[0][0])


def test_trains_a_step(task):
    model = task.build_model()
    batch = next(task.batches(shard=0, num_shards=1, seed=0, batch_size=2))
    loss = task.loss(model, batch)
    loss.backward()
    assert torch.isfinite(loss) and task.num_tokens(batch) == 64
    assert len(list(task.val_batches(batch_size=4))) == 8
