"""Where ``--log-with`` also sends the metrics records: TensorBoard event files, W&B
(offline unless WANDB_MODE says otherwise; project from ``--wandb-project`` /
WANDB_PROJECT) or MLflow (a local SQLite store unless MLFLOW_TRACKING_URI is set).
Each is an optional extra, imported only when asked for."""

from __future__ import annotations

import os
from typing import Any, Protocol

from ddiloco_cli.errors import UsageError

LOGGERS = ("tensorboard", "wandb", "mlflow")


# --------------------------------------------------------------- external loggers
class MetricsLogger(Protocol):
    """Where ``--log-with`` forwards each record (from the flusher thread, never the loop)."""

    def log(self, record: dict[str, Any], *, role: str, writer_id: str) -> int: ...

    def close(self) -> None: ...


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in record.items()
            if k not in ("t", "step") and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardLogger:
    """Scalars to TensorBoard event files (``pip install 'ddiloco[tensorboard]'``)."""

    def __init__(self, log_dir: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UsageError("TensorBoard logging needs the tensorboard package: pip install 'ddiloco[tensorboard]'") from None
        self.writer = SummaryWriter(log_dir=log_dir)

    def log(self, record: dict[str, Any], *, role: str, writer_id: str) -> int:
        scalars = _scalars(record)
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, global_step=int(record["step"]), walltime=float(record["t"]))
        return len(scalars)

    def close(self) -> None:
        self.writer.close()


def wandb_project() -> str:
    """The W&B project: ``WANDB_PROJECT`` (which ``--wandb-project`` sets), else "ddiloco"."""
    return os.environ.get("WANDB_PROJECT") or "ddiloco"


class WandbLogger:
    """Weights & Biases in offline mode unless WANDB_MODE says otherwise
    (``pip install 'ddiloco[wandb]'``; ``wandb sync`` uploads later)."""

    def __init__(self, *, run_id: str, role: str, writer_id: str, log_dir: str):
        try:
            import wandb
        except ImportError:
            raise UsageError("W&B logging needs the wandb package: pip install 'ddiloco[wandb]'") from None
        os.environ.setdefault("WANDB_MODE", "offline")
        self.run = wandb.init(project=wandb_project(), group=run_id, name=f"{role}-{writer_id}", dir=log_dir,
                              reinit=True)

    def log(self, record: dict[str, Any], *, role: str, writer_id: str) -> int:
        scalars = _scalars(record)
        self.run.log(scalars, step=int(record["step"]))
        return len(scalars)

    def close(self) -> None:
        self.run.finish()


class MlflowLogger:
    """MLflow to a local SQLite store (``<log_dir>/mlflow.db``; MLflow's file store is
    frozen) unless MLFLOW_TRACKING_URI says otherwise (``pip install 'ddiloco[mlflow]'``)."""

    def __init__(self, *, run_id: str, role: str, writer_id: str, log_dir: str):
        try:
            import mlflow
        except ImportError:
            raise UsageError("MLflow logging needs the mlflow package: pip install 'ddiloco[mlflow]'") from None
        os.makedirs(log_dir, exist_ok=True)
        self.client = mlflow.MlflowClient(tracking_uri=os.environ.get("MLFLOW_TRACKING_URI")
                                          or f"sqlite:///{os.path.abspath(os.path.join(log_dir, 'mlflow.db'))}")
        exp = self.client.get_experiment_by_name(f"ddiloco-{run_id}")
        exp_id = exp.experiment_id if exp else self.client.create_experiment(f"ddiloco-{run_id}")
        self.run_id = self.client.create_run(exp_id, run_name=f"{role}-{writer_id}").info.run_id

    def log(self, record: dict[str, Any], *, role: str, writer_id: str) -> int:
        scalars = _scalars(record)
        for k, v in scalars.items():
            self.client.log_metric(self.run_id, k, v, timestamp=int(record["t"] * 1000), step=int(record["step"]))
        return len(scalars)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def make_logger(name: str, *, run_id: str, role: str, writer_id: str, log_dir: str) -> MetricsLogger:
    """The external logger ``--log-with NAME`` asks for, writing under log_dir."""
    if name == "tensorboard":
        return TensorBoardLogger(os.path.join(log_dir, role, writer_id))
    if name == "wandb":
        return WandbLogger(run_id=run_id, role=role, writer_id=writer_id, log_dir=log_dir)
    if name == "mlflow":
        return MlflowLogger(run_id=run_id, role=role, writer_id=writer_id, log_dir=log_dir)
    raise UsageError(f"--log-with {name!r}: choose one of {', '.join(LOGGERS)}")
