"""A task that streams a Hugging Face ``datasets`` corpus, sharded per learner, resumable.

    export DDILOCO_TEXT_FILES='data/*.txt'                          # local text files, one example per line
    ddiloco init URL --task examples.hf_streaming_task:task ...      (module form: run from the repo root)
    ddiloco learn URL --learner-id a --shard 0 --num-shards 4

* ``load_dataset(..., streaming=True)`` reads the corpus lazily (local files here; a hub
  dataset name works the same when the machine may download).
* ``split_dataset_by_node(ds, rank=shard, world_size=num_shards)`` gives each learner
  its own part of the stream: distinct shards never see the same example.
* ``batches(..., state=...)`` resumes: the learner saves ``stream.state_dict()`` (the
  dataset's own ``state_dict()`` plus the bytes not yet cut into a window) at every
  send, and hands it back after a restart, so a preempted learner continues where it
  stopped instead of replaying its first examples. (A ``shuffle`` buffer, if you add
  one, is not part of the dataset's state: its content is lost on resume.)

The model and loss are the built-in HF task's (a transformers causal LM over UTF-8
bytes). Needs ``pip install datasets 'ddiloco[hf]'``; tests/unit/test_hf_streaming.py runs
it on a local text file (skipped where ``datasets`` is not installed).
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import torch

from ddiloco_cli.tasks.hf import causal_lm

DATA_FILES = os.environ.get("DDILOCO_TEXT_FILES", "data/*.txt")  # local text files, one example per line
MODEL = dict(config="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


class StreamingTextTask:
    def __init__(self, *, data_files: str = DATA_FILES, seq_len: int = 128, text_field: str = "text"):
        self.lm = causal_lm(seq_len=seq_len, **MODEL)  # model, loss, byte tokenizer
        self.data_files, self.seq_len, self.text_field = data_files, seq_len, text_field

    def _dataset(self, *, shard: int, num_shards: int):
        from datasets import load_dataset
        from datasets.distributed import split_dataset_by_node

        ds = load_dataset("text", data_files=self.data_files, split="train", streaming=True)
        return split_dataset_by_node(ds, rank=shard, world_size=num_shards)

    def build_model(self) -> torch.nn.Module:
        return self.lm.build_model()

    def batches(self, *, shard: int, num_shards: int, seed: int, batch_size: int,
                state: dict[str, Any] | None = None) -> "ByteWindows":
        return ByteWindows(lambda: self._dataset(shard=shard, num_shards=num_shards), field=self.text_field,
                           seq_len=self.seq_len, batch_size=batch_size, state=state)

    def val_batches(self, *, batch_size: int) -> Iterator[tuple]:
        stream = ByteWindows(lambda: self._dataset(shard=0, num_shards=1), field=self.text_field,
                             seq_len=self.seq_len, batch_size=batch_size, state=None, epochs=1)
        for _, batch in zip(range(8), stream):  # the first 8 batches: a fixed set
            yield batch

    def loss(self, model: torch.nn.Module, batch: tuple) -> torch.Tensor:
        return self.lm.loss(model, batch)

    def num_tokens(self, batch: tuple) -> int:
        return self.lm.num_tokens(batch)


class ByteWindows:
    """(x, y) batches of byte windows packed from a streaming dataset, endlessly (one
    pass per epoch), with a JSON-able ``state_dict()`` to resume from."""

    def __init__(self, make_dataset, *, field: str, seq_len: int, batch_size: int,
                 state: dict[str, Any] | None, epochs: int | None = None):
        self.make_dataset, self.field, self.seq_len, self.batch_size = make_dataset, field, seq_len, batch_size
        self.epochs = epochs
        self.epoch = int(state["epoch"]) if state else 0
        self.buffer: list[int] = list(state["buffer"]) if state else []
        self.dataset = make_dataset()
        if state and state.get("dataset") is not None:
            self.dataset.load_state_dict(state["dataset"])
        self.examples = iter(self.dataset)

    def __iter__(self) -> "ByteWindows":
        return self

    def _window(self) -> list[int]:
        while len(self.buffer) < self.seq_len + 1:
            try:
                example = next(self.examples)
            except StopIteration:
                self.epoch += 1
                if self.epochs is not None and self.epoch >= self.epochs:
                    raise
                self.dataset = self.make_dataset()  # the next pass over the shard
                self.examples = iter(self.dataset)
                continue
            self.buffer.extend(example[self.field].encode("utf-8") + b"\n")
        window, self.buffer = self.buffer[:self.seq_len + 1], self.buffer[self.seq_len + 1:]
        return window

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = torch.tensor([self._window() for _ in range(self.batch_size)], dtype=torch.int64)
        return chunk[:, :-1], chunk[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "buffer": list(self.buffer), "dataset": self.dataset.state_dict()}


task = StreamingTextTask
