"""Decoupled DiLoCo in your own PyTorch training loop: four added lines.

    ddiloco init runs/own --task ddiloco_cli.tasks.gpt:tiny -P 2 -H 8
    ddiloco sync runs/own &
    python examples/own_loop.py runs/own --learner-id me --steps 200

The model must be the run's (same parameter names and shapes); here it is the
built-in tiny GPT. Everything else (optimizer, schedule, data, logging) is yours.
"""

import argparse
import zlib

import torch
from torch.nn import functional as F

from ddiloco_cli import DiLoCoSync
from ddiloco_cli.tasks.gpt import tiny


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("url")
    ap.add_argument("--learner-id", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=2e-3)
    args = ap.parse_args()

    torch.manual_seed(0)
    model = tiny.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    batches = tiny.batches(shard=0, num_shards=1, seed=zlib.crc32(args.learner_id.encode()), batch_size=8)

    with DiLoCoSync(args.url, model, learner_id=args.learner_id) as sync:  # loads the global model
        for _ in range(args.steps):
            x, y = next(batches)
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync.step(num_tokens=x.numel())  # sends and receives fragments; never waits
            if sync.should_stop:  # SIGTERM, or the run's total_steps reached
                break
            if sync.step_count % 20 == 0:
                print(f"step {sync.step_count} loss {loss.item():.4f} versions {sync.stats.versions}", flush=True)
    print(f"done: {sync.stop_reason or 'steps'} at step {sync.step_count}, "
          f"{sync.stats.num_contributions} contributions", flush=True)


if __name__ == "__main__":
    main()
