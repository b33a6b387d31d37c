"""A task whose model is big enough (8 x 1M parameters) that `init` takes a while to
write version 0, so that a kill -9 can land between plan.json and run.json. Only
`init` uses it: it never trains."""

import torch


class WideTask:
    def build_model(self) -> torch.nn.Module:
        return torch.nn.Sequential(*[torch.nn.Linear(1000, 1000) for _ in range(8)])

    def batches(self, *, shard: int, num_shards: int, seed: int, batch_size: int):
        raise NotImplementedError("WideTask is for init only")

    def loss(self, model: torch.nn.Module, batch) -> torch.Tensor:
        raise NotImplementedError("WideTask is for init only")

    def num_tokens(self, batch) -> int:
        raise NotImplementedError("WideTask is for init only")
