"""The metrics history written to local files (`ddiloco metrics --csv / --tensorboard`),
and the checks every local output path gets before any bucket read (export, plot)."""

from __future__ import annotations

import csv
import os
import sys
from typing import TYPE_CHECKING

from ddiloco_cli.errors import UsageError
from ddiloco_cli.ops.metric_loggers import TensorBoardLogger

if TYPE_CHECKING:
    from ddiloco_cli.ops.metrics import Record


def write_csv(records: list[Record], path: str) -> int:
    """One row per record: role, writer_id, then every field seen (sorted), to the file
    ``path`` or, for ``-``, to stdout. Returns rows."""
    if path == "-":
        return _csv_rows(records, sys.stdout)
    check_output_path(path)
    make_parent(path)
    with open(path, "w", newline="") as f:
        return _csv_rows(records, f)


def _csv_rows(records: list[Record], f) -> int:
    fields = sorted({k for r in records for k in r.fields} - {"t", "step"})
    w = csv.writer(f)
    w.writerow(["role", "writer_id", "t", "step", *fields])
    for r in records:
        w.writerow([r.role, r.writer_id, r.fields["t"], r.fields["step"], *(r.fields.get(k, "") for k in fields)])
    return len(records)


def write_tensorboard(records: list[Record], log_dir: str) -> int:
    """One TensorBoard run per writer (``<log_dir>/<role>/<id>``), a scalar per numeric
    field at the record's step, wall time = the record's time. Returns the scalars written."""
    check_output_path(log_dir, directory=True)
    os.makedirs(log_dir, exist_ok=True)
    loggers: dict[tuple[str, str], TensorBoardLogger] = {}
    n = 0
    try:
        for r in records:
            logger = loggers.get((r.role, r.writer_id))
            if logger is None:
                logger = loggers[(r.role, r.writer_id)] = TensorBoardLogger(os.path.join(log_dir, r.role, r.writer_id))
            n += logger.log(r.fields, role=r.role, writer_id=r.writer_id)
    finally:
        for logger in loggers.values():
            logger.close()
    return n


def check_output_path(path: str, *, directory: bool = False) -> None:
    """Refuse, with a one-line UsageError and before any bucket read, a local output
    path that cannot be written: a file path that is a directory (or a directory path
    that is a file), or one whose nearest existing ancestor is a file or not writable.
    Missing parent directories are fine: writers make them (``make_parent``)."""
    if not directory and os.path.isdir(path):
        raise UsageError(f"{path} is a directory; give a file name, e.g. {os.path.join(path, 'model.safetensors')}")
    if directory and os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"cannot write {path}: it is a file, not a directory")
    ancestor = os.path.abspath(path) if directory else os.path.dirname(os.path.abspath(path))
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise UsageError(f"cannot write {path}: {ancestor} is a file, not a directory")
    if not os.access(ancestor, os.W_OK):
        raise UsageError(f"cannot write {path}: no permission to write in {ancestor}")


def make_parent(path: str) -> str:
    """Create the parent directory of a checked output file; return it."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    return parent
