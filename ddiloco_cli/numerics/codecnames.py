"""The codecs' names, defaults and bounds, without torch: what a run's settings are checked
against (runconfig) in commands that never touch a tensor (`status`, `inspect`, `admit`).
codec.py, quantized.py and sparse.py take these values from here."""

from __future__ import annotations

from ddiloco_cli.errors import UsageError

CODECS = ("none", "bf16", "int8", "int4", "sparse")
QMAX = {"int8": 127, "int4": 7}  # what an encoder writes: |q| <= QMAX
# chunks of 1024 since 0.2.5 (4096 before): a better loss per step at the same bytes, measured in
# the simulation and in real runs (docs/sparse.md, "The defaults since 0.2.5")
SPARSE_DEFAULT_CHUNK = 1024
SPARSE_DEFAULT_DENSITY = 0.02
# a new run's published deltas carry this many times the uploads' density (at most 1): a merge of
# several learners holds the union of their supports (docs/sparse.md, "Where the quality goes")
SPARSE_PUBLISH_FACTOR = 2
DEFAULT_BLOCK_SIZE = {"int8": 256, "int4": 64, "sparse": SPARSE_DEFAULT_CHUNK}
# the bound on |code| a new run's encoders use when init is not given one: int4 at 3 (7 levels
# of its 15) sends 29% fewer bytes each way, and both sides feed the error back (docs/design.md,
# "Coarser codes"); a run.json without the setting means the codec's whole range (QMAX)
DEFAULT_QMAX = {"int8": 127, "int4": 3}


def topk(density: float, chunk: int) -> int:
    """Values sent per chunk at ``density`` (at least 1, at most the chunk)."""
    return max(1, min(chunk, int(round(density * chunk))))


def check_qmax(codec: str, qmax: int | None) -> None:
    """An encoder's bound on |q| must be one the codec can hold: 1..QMAX (int4: 7, int8: 127);
    other codecs have none."""
    if qmax is None:
        return
    if codec not in QMAX:
        raise UsageError(f"--codec-qmax applies to int4 and int8 only, not to codec {codec!r}")
    if isinstance(qmax, bool) or not isinstance(qmax, int) or not 1 <= qmax <= QMAX[codec]:
        raise UsageError(f"--codec-qmax for {codec} must be an integer in [1, {QMAX[codec]}], got {qmax!r}")


__all__ = ["CODECS", "DEFAULT_BLOCK_SIZE", "DEFAULT_QMAX", "QMAX", "SPARSE_DEFAULT_CHUNK", "SPARSE_DEFAULT_DENSITY",
           "SPARSE_PUBLISH_FACTOR",
           "check_qmax", "topk"]
