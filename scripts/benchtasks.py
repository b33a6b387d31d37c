"""The benchmarks' GPT tasks, in a module that imports nothing of ddiloco beyond the task code:
the plain arm of a learner-cost benchmark (bench_overhead.py, bench_learner_memory.py) imports
this and no more of ddiloco, as a user's own training script imports its model and no more, so
its memory is the plain loop's (benchlib, which the plain arm imported before, brings in the
learner, the store and their dependencies: 14 MB of the plain arm's peak)."""

from __future__ import annotations

import os

from ddiloco_cli.tasks.gpt import GPTConfig, GPTTask
from ddiloco_cli.tasks.gpt import tiny

BENCHTASKS_PATH = os.path.abspath(__file__)

# ~3.2M parameters (4 layers, 256 wide): ~100-200 ms per step on one core at batch 8 x 64 tokens,
# fragments of ~130k parameters at P = 24, so a payload's header is a small part of it
mid = GPTTask(GPTConfig(block_size=64, n_layer=4, n_head=4, n_embd=256), default_batch_size=8)

# ~85M parameters (12 layers, 768 wide, block 256): a GPU's task (scripts/bench_gpu.py), steps of
# ~100 ms on one data-centre GPU at batch 32 in fp32; fragments of ~3.5M parameters at P = 24
big = GPTTask(GPTConfig(block_size=256, n_layer=12, n_head=12, n_embd=768), default_batch_size=32)

__all__ = ["BENCHTASKS_PATH", "big", "mid", "tiny"]
