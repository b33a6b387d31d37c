"""The optional compiled kernels (``_native.c``, built by ``pip install`` where a C compiler is
found): blockquant.py, quantized.py and merge.py call them when they are there and run their
numpy passes when not, with the same bytes either way (tests/unit/test_native.py compares them).
``DDILOCO_NATIVE=0`` in the environment leaves them out (an A/B, or to rule them out);
``DDILOCO_NATIVE_SIMD=0`` keeps them but without their AVX2 copies (``_native.simd``: the
dequantise, the merge's in-place add and int4's sums of squares in explicit vector code, picked
where the CPU has AVX2; the same values)."""

from __future__ import annotations

import os
from types import ModuleType

API = 4  # _native.c's API constant this code calls

kernels: ModuleType | None = None
why_not = ""
if os.environ.get("DDILOCO_NATIVE", "1").strip() == "0":
    why_not = "left out: DDILOCO_NATIVE=0"
else:
    try:
        from ddiloco_cli.numerics import _native as _built  # type: ignore[attr-defined]
    except ImportError as exc:  # not built here: the numpy passes
        why_not = f"not built ({exc})"
    else:
        if getattr(_built, "API", None) == API:
            kernels = _built
            if os.environ.get("DDILOCO_NATIVE_SIMD", "1").strip() == "0":
                kernels.simd(False)
        else:  # an in-place build older than this code (an editable install not rebuilt)
            why_not = f"stale build (API {getattr(_built, 'API', None)}, this code calls {API}): reinstall ddiloco"


def describe() -> str:
    """One line for `ddiloco --version`, the logs of learn and sync, and the benchmarks."""
    if kernels is None:
        return f"compiled codec kernels: {why_not}"
    return f"compiled codec kernels: in use ({'with' if kernels.simd() else 'without'} AVX2)"


def log_if_missing(log) -> None:
    """`ddiloco learn` and `ddiloco sync` say so at start when the kernels are not in use: the run
    works (the same bytes), at more CPU a step or a merge."""
    if kernels is None:
        log.info("%s: the numpy passes encode, decode and merge instead (the same bytes, more CPU; "
                 "`pip install` ddiloco where a C compiler is found to build them)", describe())
