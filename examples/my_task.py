"""A task of your own: a character bigram model, in one file.

A task is code on each machine, never something read from the bucket. Either
make it importable everywhere (a package, or PYTHONPATH) and name the module:

    PYTHONPATH=examples ddiloco init URL --task my_task:task ...
    PYTHONPATH=examples ddiloco learn URL --learner-id a

or give every command its own copy of the file:

    ddiloco init URL --task examples/my_task.py:task ...
    ddiloco learn URL --learner-id a --task examples/my_task.py:task

run.json records the sha256 of this file; a learner whose copy differs is refused.

Any object with build_model / batches / loss / num_tokens (and optionally
val_batches, to_device) is a task; see ddiloco_cli/tasks/__init__.py. This one
learns next-character probabilities of a text file (default: the Shakespeare
excerpt shipped with ddiloco; set MY_TASK_TEXT=path/to/file.txt for your own).
Its batches() takes start_step, so a restarted learner continues its stream.
"""

import os
from importlib import resources

import torch
import torch.nn as nn
from torch.nn import functional as F


class BigramTask:
    def __init__(self, text: str, *, val_fraction: float = 0.1):
        self.vocab = sorted(set(text))
        stoi = {ch: i for i, ch in enumerate(self.vocab)}
        ids = torch.tensor([stoi[ch] for ch in text], dtype=torch.long)
        n_train = int(len(ids) * (1 - val_fraction))
        self.train_ids, self.val_ids = ids[:n_train], ids[n_train:]

    def build_model(self) -> nn.Module:
        torch.manual_seed(0)
        return nn.Embedding(len(self.vocab), len(self.vocab))  # row i: logits of the char after i

    def batches(self, *, shard: int, num_shards: int, seed: int, batch_size: int, start_step: int = 0):
        # Shard s trains on the s-th contiguous slice only: distinct data without coordination.
        n = len(self.train_ids)
        lo, hi = n * shard // num_shards, n * (shard + 1) // num_shards
        g = torch.Generator().manual_seed(seed * 1_000_003 + shard)
        for _ in range(start_step):  # resume: replay the skipped draws, not the batches
            torch.randint(lo, hi - 1, (batch_size,), generator=g)
        while True:
            i = torch.randint(lo, hi - 1, (batch_size,), generator=g)
            yield {"x": self.train_ids[i], "y": self.train_ids[i + 1]}

    def val_batches(self, *, batch_size: int):
        for i in range(0, len(self.val_ids) - 1, batch_size):
            j = torch.arange(i, min(i + batch_size, len(self.val_ids) - 1))
            yield {"x": self.val_ids[j], "y": self.val_ids[j + 1]}

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return F.cross_entropy(model(batch["x"]), batch["y"])

    def num_tokens(self, batch: dict) -> int:
        return batch["x"].numel()


def task() -> BigramTask:
    """Zero-argument factory: load_task calls it, so nothing is read at import time."""
    path = os.environ.get("MY_TASK_TEXT")
    if path:
        with open(path, encoding="utf-8") as f:
            return BigramTask(f.read())
    return BigramTask(resources.files("ddiloco_cli").joinpath("data/shakespeare_excerpt.txt").read_text("utf-8"))
