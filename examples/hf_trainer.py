"""Decoupled DiLoCo inside a Hugging Face ``Trainer``: one callback.

    ddiloco init runs/hf --task examples/hf_trainer.py:task -P 2 -H 8 --total-steps 0
    ddiloco sync runs/hf &
    python examples/hf_trainer.py runs/hf --learner-id hf-0 --steps 100

``DiLoCoCallback`` attaches the Trainer's model to the run when training
begins, counts each optimizer step (``on_step_end`` runs after
``optimizer.step()``), and stops the Trainer on SIGTERM or at the run's
total_steps. The model is a small randomly initialised GPT-2 over bytes: no
downloads. ``task`` below lets ``ddiloco init`` build the same model (the run
must have the Trainer model's parameter names and shapes).
"""

import argparse
from importlib import resources

import torch
from torch.nn import functional as F
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from ddiloco_cli import DiLoCoSync

BLOCK = 64
CONFIG = dict(vocab_size=256, n_positions=BLOCK, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)


def build_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**CONFIG))


def text_bytes() -> torch.Tensor:
    text = resources.files("ddiloco_cli").joinpath("data/shakespeare_excerpt.txt").read_bytes()
    return torch.tensor(list(text), dtype=torch.long)


class ByteWindows(torch.utils.data.Dataset):
    """Windows of BLOCK bytes; the model shifts the labels itself."""

    def __init__(self, data: torch.Tensor):
        self.data = data

    def __len__(self) -> int:
        return len(self.data) // BLOCK - 1

    def __getitem__(self, i: int) -> dict:
        window = self.data[i * BLOCK:(i + 1) * BLOCK]
        return {"input_ids": window, "labels": window}


class DiLoCoCallback(TrainerCallback):
    def __init__(self, url: str, *, learner_id: str, tokens_per_step: int, storage_options: dict | None = None):
        self.url, self.learner_id, self.tokens_per_step = url, learner_id, tokens_per_step
        self.storage_options = storage_options
        self.sync: DiLoCoSync | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.sync = DiLoCoSync(self.url, model, learner_id=self.learner_id, storage_options=self.storage_options)
        self.sync.start()  # the global model replaces the Trainer's initial weights

    def on_step_end(self, args, state, control, **kwargs):
        self.sync.step(num_tokens=self.tokens_per_step)
        if self.sync.should_stop:
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        self.sync.close()


class _Task:
    """What ``ddiloco init`` (and ``ddiloco learn``) need to build this run's model."""

    def build_model(self) -> GPT2LMHeadModel:
        return build_model()

    def batches(self, *, shard: int, num_shards: int, seed: int, batch_size: int):
        data = text_bytes()
        g = torch.Generator().manual_seed(seed * 1_000_003 + shard)
        while True:
            i = torch.randint(0, len(data) - BLOCK, (batch_size,), generator=g)
            yield torch.stack([data[j:j + BLOCK] for j in i.tolist()])

    def loss(self, model, batch: torch.Tensor) -> torch.Tensor:
        logits = model(batch).logits[:, :-1]
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def num_tokens(self, batch: torch.Tensor) -> int:
        return batch.numel()


def task() -> _Task:
    return _Task()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("url")
    ap.add_argument("--learner-id", required=True)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--output-dir", default="runs/hf-trainer-out")
    args = ap.parse_args()

    batch_size = 8
    training = TrainingArguments(output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=batch_size,
                                 learning_rate=2e-3, lr_scheduler_type="constant", logging_steps=10,
                                 save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0,
                                 disable_tqdm=True)
    callback = DiLoCoCallback(args.url, learner_id=args.learner_id, tokens_per_step=batch_size * BLOCK)
    trainer = Trainer(model=build_model(), args=training, train_dataset=ByteWindows(text_bytes()),
                      callbacks=[callback])
    trainer.train()
    sync = callback.sync
    print(f"done: {sync.stop_reason or 'steps'} at step {sync.step_count}, "
          f"{sync.stats.num_contributions} contributions", flush=True)


if __name__ == "__main__":
    main()
