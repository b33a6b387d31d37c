"""Built-in task: a small nanoGPT-style decoder trained on Shakespeare, char-level.

Select one with ``--task ddiloco_cli.tasks.gpt:NAME`` (or just ``--task NAME``):

    tiny    ~0.2M params, block 64    tests and the CPU demo
    small   ~10.7M params, block 256  a few CPU cores or one small GPU
    medium  ~100M params, block 1024  GPU

Data lives in a directory holding ``train.bin``/``val.bin`` (uint16 token ids) and
``meta.json`` (vocabulary, sizes, source). The directory is ``$DDILOCO_DATA_DIR``,
else ``~/.cache/ddiloco/shakespeare``. When it holds no data yet, the first task
that needs it builds it from the excerpt shipped in the package, so everything
works offline; ``scripts/prepare_data.py`` builds the complete works instead.
"""

import hashlib
import json
import math
import os
import tempfile
from dataclasses import dataclass
from importlib import resources
from typing import Iterator

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

from ddiloco_cli.errors import UsageError

# -----------------------------------------------------------------------------
# model


@dataclass
class GPTConfig:
    vocab_size: int = 96
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False  # biases in Linear and LayerNorm layers


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_size)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer. ``forward(idx)`` maps (B, T) token ids to (B, T, vocab)
    logits. The token embedding and the output head share one weight (weight tying), so
    ``named_parameters()`` lists it once, as ``transformer.wte.weight``; ``state_dict()``
    lists it twice (also as ``lm_head.weight``)."""

    def __init__(self, config: GPTConfig, *, init_seed: int = 0):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

        # Initialise from our own generator: every process that builds the model gets the
        # same weights without touching the global RNG or talking to anybody.
        g = torch.Generator().manual_seed(init_seed)
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)  # GPT-2: scale residual projections
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=residual_std, generator=g)
            elif p.dim() >= 2:
                nn.init.normal_(p, mean=0.0, std=0.02, generator=g)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            else:  # LayerNorm weights
                nn.init.ones_(p)

    def num_params(self, *, non_embedding: bool = True) -> int:
        """Parameter count; the position embedding is left out unless non_embedding=False
        (the token embedding is the output head, so it always counts)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.size()
        assert T <= self.config.block_size, f"sequence of {T} > block_size {self.config.block_size}"
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Extend (B, T) token ids by max_new_tokens sampled tokens."""
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -self.config.block_size:]
            logits = self(idx_cond)[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


# -----------------------------------------------------------------------------
# char-level token files

# Every text gets at least these characters (newline + printable ASCII: 96 symbols),
# so the excerpt and the complete works share one vocabulary and one model shape.
BASE_CHARS = "\n" + "".join(chr(i) for i in range(32, 127))
VOCAB_MULTIPLE = 8  # padded vocab_size; the pad ids never occur in the data


def default_data_dir() -> str:
    return os.environ.get("DDILOCO_DATA_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "ddiloco", "shakespeare")


def build_vocab(text: str) -> str:
    """The vocabulary for text: BASE_CHARS first, then any other character in sorted order."""
    extra = sorted(set(text) - set(BASE_CHARS))
    return BASE_CHARS + "".join(extra)


def encode(text: str, vocab: str) -> np.ndarray:
    stoi = {ch: i for i, ch in enumerate(vocab)}
    return np.array([stoi[ch] for ch in text], dtype=np.uint16)


def decode(ids, vocab: str) -> str:
    return "".join(vocab[int(i)] if int(i) < len(vocab) else "?" for i in ids)


def _atomic_write(path: str, data: bytes) -> None:
    """Write data to path so readers only ever see the old or the complete new file:
    temp file in the same directory, fsync, os.replace."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix="." + os.path.basename(path) + ".")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)  # mkstemp makes it 0600
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_token_files(text: str, out_dir: str, *, source: str, source_sha256: str | None = None,
                      val_fraction: float = 0.1) -> dict:
    """Tokenize text, split it (first 1 - val_fraction to train, the rest to val) and write
    train.bin, val.bin and, last, meta.json into out_dir, each atomically. meta.json is
    written last, so its presence means the set is complete. Several processes may call
    this at once with the same text: they write identical files. source and
    source_sha256 (of the original download) are recorded in meta.json. Returns meta."""
    os.makedirs(out_dir, exist_ok=True)
    vocab = build_vocab(text)
    assert len(vocab) < 2**16
    ids = encode(text, vocab)
    n_train = int(len(ids) * (1 - val_fraction))
    meta = {
        "format": "ddiloco-char-tokens-v1",
        "vocab": vocab,
        "vocab_size": math.ceil(len(vocab) / VOCAB_MULTIPLE) * VOCAB_MULTIPLE,
        "dtype": "uint16",
        "num_train_tokens": n_train,
        "num_val_tokens": len(ids) - n_train,
        "source": source,
        "source_sha256": source_sha256,
        "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
    }
    _atomic_write(os.path.join(out_dir, "train.bin"), ids[:n_train].tobytes())
    _atomic_write(os.path.join(out_dir, "val.bin"), ids[n_train:].tobytes())
    _atomic_write(os.path.join(out_dir, "meta.json"), json.dumps(meta, indent=1).encode())
    return meta


def excerpt_text() -> str:
    return resources.files("ddiloco_cli").joinpath("data/shakespeare_excerpt.txt").read_text("utf-8")


def ensure_token_files(data_dir: str) -> dict:
    """Return the meta dict of data_dir, first building the token files from the shipped
    excerpt if data_dir holds none. Raises UsageError if the files disagree with meta.json."""
    meta_path = os.path.join(data_dir, "meta.json")
    if not os.path.exists(meta_path):
        write_token_files(excerpt_text(), data_dir, source="ddiloco_cli/data/shakespeare_excerpt.txt")
    with open(meta_path) as f:
        meta = json.load(f)
    for split in ("train", "val"):
        path = os.path.join(data_dir, f"{split}.bin")
        expected = 2 * meta[f"num_{split}_tokens"]
        if not os.path.exists(path) or os.path.getsize(path) != expected:
            raise UsageError(f"{path} does not match {meta_path} (expected {expected} bytes); "
                             f"rebuild it with scripts/prepare_data.py --out {data_dir}, or delete the directory")
    return meta


# -----------------------------------------------------------------------------
# tasks


def _generator(*parts: int) -> torch.Generator:
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


class GPTTask:
    """Next-character prediction on a token-file directory. Batches are (x, y) int64
    tensors of shape (batch_size, block_size); y is x shifted by one token."""

    def __init__(self, config: GPTConfig, *, default_batch_size: int, data_dir: str | None = None):
        self.config = config  # vocab_size is replaced by the data's when the model is built
        self.default_batch_size = default_batch_size
        self._data_dir = data_dir
        self._meta: dict[str, dict] = {}  # data dir -> its meta.json, read once

    @property
    def data_dir(self) -> str:
        return self._data_dir or default_data_dir()

    @property
    def meta(self) -> dict:
        """meta.json of data_dir, building the token files from the excerpt if needed."""
        data_dir = self.data_dir
        if data_dir not in self._meta:
            self._meta[data_dir] = ensure_token_files(data_dir)
        return self._meta[data_dir]

    def _tokens(self, split: str) -> np.ndarray:
        self.meta  # build the files first if needed
        return np.memmap(os.path.join(self.data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")

    def model_config(self) -> GPTConfig:
        return GPTConfig(**{**self.config.__dict__, "vocab_size": self.meta["vocab_size"]})

    def build_model(self) -> GPT:
        """A freshly initialised model; identical in every process (fixed init seed)."""
        return GPT(self.model_config())

    def batches(self, *, shard: int, num_shards: int, seed: int, batch_size: int,
                start_step: int = 0) -> Iterator[tuple]:
        """Endless random windows from the shard-th contiguous 1/num_shards slice of train
        tokens, drawn with a generator seeded by (seed, shard): the same arguments give
        the same stream, distinct shards never share a window start. ``start_step``
        continues the stream after that many batches (a restarted learner's resume)."""
        if not 0 <= shard < num_shards:
            raise UsageError(f"shard {shard} is outside 0..{num_shards - 1}")
        data = self._tokens("train")
        T = self.config.block_size
        lo, hi = len(data) * shard // num_shards, len(data) * (shard + 1) // num_shards
        if hi - lo < T + 2:
            raise UsageError(f"{num_shards} shards leave {hi - lo} tokens each, fewer than one window "
                             f"of {T + 1}; use fewer learners or more data (scripts/prepare_data.py)")
        g = _generator(seed, shard)
        for _ in range(start_step):  # the same draws as the skipped batches, without reading tokens
            torch.randint(lo, hi - T - 1 + 1, (batch_size,), generator=g)
        while True:
            starts = torch.randint(lo, hi - T - 1 + 1, (batch_size,), generator=g).tolist()
            yield self._windows(data, starts)

    def val_batches(self, *, batch_size: int) -> Iterator[tuple]:
        """Non-overlapping windows of val tokens, in order: the same set every call."""
        data = self._tokens("val")
        T = self.config.block_size
        starts = list(range(0, len(data) - T - 1 + 1, T))
        for i in range(0, len(starts), batch_size):
            yield self._windows(data, starts[i:i + batch_size])

    def _windows(self, data: np.ndarray, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.config.block_size
        chunk = torch.from_numpy(np.stack([data[s:s + T + 1] for s in starts]).astype(np.int64))
        return chunk[:, :-1], chunk[:, 1:]

    def loss(self, model: nn.Module, batch: tuple) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))

    def num_tokens(self, batch: tuple) -> int:
        return batch[0].numel()

    def encode(self, text: str) -> torch.Tensor:
        return torch.from_numpy(encode(text, self.meta["vocab"]).astype(np.int64))

    def decode(self, ids) -> str:
        return decode(ids, self.meta["vocab"])


tiny = GPTTask(GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=96), default_batch_size=16)
small = GPTTask(GPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=384), default_batch_size=32)
medium = GPTTask(GPTConfig(block_size=1024, n_layer=14, n_head=12, n_embd=768), default_batch_size=16)
