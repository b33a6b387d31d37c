"""The C allocator's thresholds for a training process (glibc only).

With glibc's defaults a block of 128 KiB or more is mapped fresh from the kernel and unmapped
when freed (the threshold then rises with what was freed, up to 32 MiB), and the heap's free top
is handed back above twice that threshold. A training step allocates and frees the same large
activations every step; the learner's fragment-sized buffers (gathers, deltas, increments)
between them most likely move the thresholds and the heap's top (inferred), and the step then
faults its memory in again: 885 minor page faults a step on the training thread against the plain loop's 340, and
+5.6% wall time per step, in `bench_overhead.py` (docs/results.md, "Learner overhead"). With
both thresholds fixed, blocks below 32 MiB stay in the process's heap and are reused: 1 fault a
step, and the A/B reads +0.7%.

``tune()`` fixes them once (``mallopt``) unless the user chose otherwise: ``MALLOC_MMAP_THRESHOLD_``
or ``MALLOC_TRIM_THRESHOLD_`` set in the environment (glibc read them at start), or
``DDILOCO_MALLOC_TUNING=0``. Memory: the heap keeps what it freed; ``release_free()`` hands it
back once, after the learner's start-up read (docs/learner.md, "The allocator"). Not glibc (macOS,
musl): nothing is done.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Mapping

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 256 * 2**20
ARENAS = 1  # every thread allocates from the main heap (see tune)
ENV_OPT_OUT = "DDILOCO_MALLOC_TUNING"
GLIBC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
ARENA_ENV = "MALLOC_ARENA_MAX"

_lock = threading.Lock()
_done: bool | None = None


def _glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc (it has ``gnu_get_libc_version`` and ``mallopt``)."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (an AttributeError when not glibc)
        return libc if hasattr(libc, "mallopt") else None
    except (OSError, AttributeError):
        return None


def _opted_out(environ: Mapping[str, str]) -> bool:
    return environ.get(ENV_OPT_OUT, "1").strip().lower() in ("0", "false", "no", "off")


def wanted(environ: Mapping[str, str] = os.environ) -> tuple[bool, str]:
    """Whether to tune, and why not when not."""
    if _opted_out(environ):
        return False, f"{ENV_OPT_OUT}={environ[ENV_OPT_OUT]}"
    chosen = [name for name in GLIBC_ENV if name in environ]
    if chosen:
        return False, f"{', '.join(chosen)} set in the environment"
    return True, ""


def tune(environ: Mapping[str, str] = os.environ, *, libc: ctypes.CDLL | None = None) -> bool:
    """Fix glibc's mmap and trim thresholds for this process (once; later calls return the first
    call's answer). Returns whether they were set.

    With them it also keeps every thread that allocates from now on in the main heap (one
    arena, unless ``MALLOC_ARENA_MAX`` is set in the environment): glibc gives each new thread
    that allocates its own arena, and with the fixed thresholds each arena keeps what its thread
    freed; the learner's worker threads (upload, receive, the start-up read's) then hold their
    fragment-sized buffers' pages apart from the training thread's, 9-10 MB of the 3.2M-parameter
    GPT's peak (docs/learner.md, "The allocator"). Call it before those threads start."""
    global _done
    with _lock:
        if _done is not None:
            return _done
        ok, why = wanted(environ)
        libc = libc if libc is not None else (_glibc() if ok else None)
        if not ok:
            log.debug("allocator thresholds left as they are: %s", why)
            _done = False
        elif libc is None:
            log.debug("allocator thresholds left as they are: not glibc")
            _done = False
        else:
            _done = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
                libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
            arenas = _done and ARENA_ENV not in environ and bool(libc.mallopt(M_ARENA_MAX, ARENAS))
            log.debug("allocator thresholds %s: mmap %d, trim %d; arenas %s", "set" if _done else "refused by mallopt",
                      MMAP_THRESHOLD, TRIM_THRESHOLD, ARENAS if arenas else "left as they are")
        return _done


def release_free(environ: Mapping[str, str] = os.environ, *, libc: ctypes.CDLL | None = None) -> bool:
    """Hand the free pages of every heap back to the kernel (glibc's ``malloc_trim(0)``); returns
    whether it ran. For the end of a start-up: the cold read's threads leave their arenas holding
    what they fetched (about 4 MB each, the threads gone), which the fixed trim threshold would
    otherwise keep for the whole run. Not during training: the step would fault its memory in
    again. Nothing with ``DDILOCO_MALLOC_TUNING=0`` or when the C library is not glibc."""
    if _opted_out(environ):
        return False
    libc = libc if libc is not None else _glibc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim(0)
    return True


def _reset_for_tests() -> None:
    global _done
    with _lock:
        _done = None


__all__ = ["tune", "wanted", "release_free", "ENV_OPT_OUT", "MMAP_THRESHOLD", "TRIM_THRESHOLD"]
