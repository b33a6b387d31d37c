"""Built-in task: any Hugging Face ``transformers`` causal LM, built from a config.

    ddiloco init URL --task 'ddiloco_cli.tasks.hf:causal_lm?config=llama&hidden_size=256&num_hidden_layers=4'

``config`` is a ``model_type`` (``gpt2``, ``llama``, ``qwen2``, ``mistral``, ...) whose
defaults the other arguments override, or the path of a local ``config.json`` (or a
directory holding one; it must exist at that path on every machine). ``seq_len`` is
the window length, ``text`` a local UTF-8 file to train on (default: the Shakespeare
excerpt shipped with ddiloco). Nothing is downloaded: the model is initialised from
the config, and the tokenizer is byte-level (token id = UTF-8 byte, vocabulary 256),
so ``vocab_size`` is set to 256. Giving ``hidden_size`` scales the sizes the
model_type derives from it (``intermediate_size``, ``ffn_dim``) by the default's
ratio unless they are given too. ``ddiloco export URL --hf-dir DIR`` writes a
directory ``AutoModelForCausalLM.from_pretrained(DIR)`` loads.

Needs ``pip install 'ddiloco[hf]'``.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

from ddiloco_cli.errors import UsageError
from ddiloco_cli.tasks.gpt import _generator, excerpt_text

BYTE_VOCAB = 256
VAL_FRACTION = 0.1


def _transformers():
    try:
        import transformers
    except ImportError:
        raise UsageError("the hf task needs transformers: pip install 'ddiloco[hf]'") from None
    return transformers


def build_config(config: str, overrides: dict[str, Any]):
    """A transformers config from a model_type name or a local config.json, with overrides."""
    tf = _transformers()
    if config.endswith(".json") or os.path.isdir(config):
        if not os.path.exists(config):
            raise UsageError(f"hf task: config file {config!r} does not exist on this machine")
        cfg = tf.AutoConfig.from_pretrained(config, local_files_only=True)
        for k, v in overrides.items():
            setattr(cfg, k, v)
    else:
        try:
            cfg = tf.AutoConfig.for_model(config, **overrides)
            _scale_with_hidden_size(cfg, tf.AutoConfig.for_model(config), overrides)
        except ValueError as exc:
            raise UsageError(f"hf task: {exc}") from None
    cfg.vocab_size = BYTE_VOCAB
    return cfg


# sizes a model_type's defaults derive from its hidden size (llama: 11008 = 2.6875 * 4096)
SCALED_WITH_HIDDEN = ("intermediate_size", "ffn_dim", "n_inner")


def _scale_with_hidden_size(cfg, default, overrides: dict[str, Any]) -> None:
    """With ``hidden_size`` given and a derived size not, keep the default's ratio:
    ``config=llama&hidden_size=64`` gets intermediate_size 172, not llama-7B's 11008."""
    hidden = overrides.get("hidden_size", overrides.get("n_embd"))
    base = getattr(default, "hidden_size", None)
    if hidden is None or not base:
        return
    for name in SCALED_WITH_HIDDEN:
        value = getattr(default, name, None)
        if name not in overrides and isinstance(value, int) and value > 0:
            setattr(cfg, name, max(1, round(value * int(hidden) / base)))


class CausalLMTask:
    """Next-byte prediction with a transformers causal LM. Batches are (x, y) int64
    tensors of shape (batch_size, seq_len); y is x shifted by one byte."""

    def __init__(self, config, *, seq_len: int = 128, text_path: str | None = None):
        if seq_len < 2:
            raise UsageError("hf task: seq_len must be >= 2")
        self.config, self.seq_len, self.text_path = config, seq_len, text_path
        self._data: dict[str, np.ndarray] = {}

    def _split(self, split: str) -> np.ndarray:
        if not self._data:
            if self.text_path is not None:
                if not os.path.isfile(self.text_path):
                    raise UsageError(f"hf task: text file {self.text_path!r} does not exist on this machine")
                with open(self.text_path, "rb") as f:
                    raw = f.read()
            else:
                raw = excerpt_text().encode("utf-8")
            data = np.frombuffer(raw, dtype=np.uint8)
            cut = int(len(data) * (1 - VAL_FRACTION))
            self._data = {"train": data[:cut], "val": data[cut:]}
            for name, part in self._data.items():
                if len(part) < self.seq_len + 2:
                    raise UsageError(f"hf task: the {name} split has {len(part)} bytes, fewer than one window "
                                     f"of {self.seq_len + 1}; use a smaller seq_len or more text")
        return self._data[split]

    def build_model(self) -> nn.Module:
        return _transformers().AutoModelForCausalLM.from_config(self.config)

    def batches(self, *, shard: int, num_shards: int, seed: int, batch_size: int) -> Iterator[tuple]:
        """Endless random windows from the shard-th contiguous slice of the train bytes."""
        if not 0 <= shard < num_shards:
            raise UsageError(f"shard {shard} is outside 0..{num_shards - 1}")
        data, T = self._split("train"), self.seq_len
        lo, hi = len(data) * shard // num_shards, len(data) * (shard + 1) // num_shards
        if hi - lo < T + 2:
            raise UsageError(f"hf task: {num_shards} shards leave {hi - lo} bytes each, fewer than one window")
        g = _generator(seed, shard)
        while True:
            yield self._windows(data, torch.randint(lo, hi - T, (batch_size,), generator=g).tolist())

    def val_batches(self, *, batch_size: int) -> Iterator[tuple]:
        """Non-overlapping windows of the val bytes, in order: the same set every call."""
        data, T = self._split("val"), self.seq_len
        starts = list(range(0, len(data) - T, T))
        for i in range(0, len(starts), batch_size):
            yield self._windows(data, starts[i:i + batch_size])

    def _windows(self, data: np.ndarray, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.seq_len
        chunk = torch.from_numpy(np.stack([data[s:s + T + 1] for s in starts]).astype(np.int64))
        return chunk[:, :-1], chunk[:, 1:]

    def loss(self, model: nn.Module, batch: tuple) -> torch.Tensor:
        x, y = batch
        logits = model(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))

    def num_tokens(self, batch: tuple) -> int:
        return batch[0].numel()

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def causal_lm(config: str = "gpt2", seq_len: int = 128, text: str | None = None, **overrides: Any) -> CausalLMTask:
    """The task for ``--task 'ddiloco_cli.tasks.hf:causal_lm?config=...&key=value'``."""
    return CausalLMTask(build_config(config, overrides), seq_len=int(seq_len), text_path=text)
