"""ddiloco: Decoupled DiLoCo over a shared bucket.

``from ddiloco_cli import DiLoCoSync`` attaches any training loop to a run (see
``ddiloco_cli.learner.sync``); it is imported on first use, so the CLI starts
without loading torch.
"""
__version__ = "0.2.16"

__all__ = ["DiLoCoSync", "SyncOptions"]


def __getattr__(name: str):
    if name in __all__:
        from ddiloco_cli.learner import sync  # noqa: PLC0415 - lazy: torch is heavy

        return getattr(sync, name)
    raise AttributeError(f"module 'ddiloco_cli' has no attribute {name!r}")
