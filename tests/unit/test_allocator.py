"""The learner's allocator thresholds (ddiloco_cli.learner.allocator): when they are set, and
that they take effect (a large block then comes from the heap). What they do to the step time is
measured by scripts/bench_overhead.py (docs/results.md, "Learner overhead")."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ddiloco_cli.learner import allocator

GLIBC = allocator._glibc() is not None

# a fresh process: where a 4 MiB block comes from. glibc's default (a 128 KiB mmap threshold at
# start) maps it fresh from the kernel, outside the heap, and unmaps it on free, so the next one
# faults its pages in again; with the learner's thresholds it comes from the heap and is reused.
PATTERN = r"""
import ctypes, json
from ddiloco_cli.learner import allocator
tuned = allocator.tune()
block = bytearray(4 << 20)
address = ctypes.addressof((ctypes.c_char * len(block)).from_buffer(block))
heap = []
with open("/proc/self/maps") as f:
    for line in f:
        if line.rstrip().endswith("[heap]"):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            heap.append((lo, hi))
print(json.dumps({"tuned": tuned, "in_heap": any(lo <= address < hi for lo, hi in heap)}))
"""


def _run(env_extra: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in allocator.GLIBC_ENV and k != allocator.ENV_OPT_OUT}
    out = subprocess.run([sys.executable, "-c", PATTERN], env={**env, **env_extra}, capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_user_or_the_environment_can_keep_glibcs_defaults():
    assert allocator.wanted({}) == (True, "")
    for off in ("0", "false", "off", "no"):
        ok, why = allocator.wanted({allocator.ENV_OPT_OUT: off})
        assert not ok and allocator.ENV_OPT_OUT in why
    ok, why = allocator.wanted({"MALLOC_TRIM_THRESHOLD_": "1000000"})
    assert not ok and "MALLOC_TRIM_THRESHOLD_" in why
    assert allocator.wanted({allocator.ENV_OPT_OUT: "1"}) == (True, "")


@pytest.mark.skipif(not GLIBC, reason="the thresholds are glibc's")
def test_tuned_thresholds_serve_large_blocks_from_the_heap():
    default = _run({allocator.ENV_OPT_OUT: "0"})
    tuned = _run({})
    assert default == {"tuned": False, "in_heap": False}
    assert tuned == {"tuned": True, "in_heap": True}
    # the user's own thresholds are left alone (here: glibc's default mmap threshold, a higher trim)
    assert _run({"MALLOC_TRIM_THRESHOLD_": str(1 << 30)}) == {"tuned": False, "in_heap": False}


@pytest.mark.skipif(not GLIBC, reason="the thresholds are glibc's")
def test_tune_sets_both_thresholds_once():
    calls = []

    class Libc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

    allocator._reset_for_tests()
    try:
        assert allocator.tune({}, libc=Libc()) is True
        assert allocator.tune({}, libc=Libc()) is True  # the first call's answer; no second mallopt
        assert calls == [(allocator.M_MMAP_THRESHOLD, allocator.MMAP_THRESHOLD),
                         (allocator.M_TRIM_THRESHOLD, allocator.TRIM_THRESHOLD),
                         (allocator.M_ARENA_MAX, allocator.ARENAS)]
        calls.clear()
        allocator._reset_for_tests()
        assert allocator.tune({allocator.ARENA_ENV: "4"}, libc=Libc()) is True  # the user's arenas stay
        assert calls == [(allocator.M_MMAP_THRESHOLD, allocator.MMAP_THRESHOLD),
                         (allocator.M_TRIM_THRESHOLD, allocator.TRIM_THRESHOLD)]
    finally:
        allocator._reset_for_tests()


# a fresh process: where a worker thread's 1 MiB block comes from. Tuned, every thread allocates
# from the main heap (the brk [heap]), so what a worker frees the training thread reuses; with
# the thresholds alone (the user's MALLOC_ARENA_MAX) the thread gets an arena of its own, whose
# freed pages no other thread reuses
THREADED = r"""
import ctypes, json, threading
from ddiloco_cli.learner import allocator
tuned = allocator.tune()
def heap():
    with open("/proc/self/maps") as f:
        return [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f
                if line.rstrip().endswith("[heap]")]
got = {}
def work():
    block = bytearray(1 << 20)
    address = ctypes.addressof((ctypes.c_char * len(block)).from_buffer(block))
    got["in_heap"] = any(lo <= address < hi for lo, hi in heap())
t = threading.Thread(target=work)
t.start()
t.join()
print(json.dumps({"tuned": tuned, **got}))
"""


@pytest.mark.skipif(not GLIBC, reason="arenas are glibc's")
def test_tuned_worker_threads_allocate_from_the_main_heap():
    env = {k: v for k, v in os.environ.items()
           if k not in (*allocator.GLIBC_ENV, allocator.ARENA_ENV, allocator.ENV_OPT_OUT)}

    def run(extra):
        out = subprocess.run([sys.executable, "-c", THREADED], env={**env, **extra}, capture_output=True, text=True,
                             check=True, timeout=120)
        return json.loads(out.stdout.strip().splitlines()[-1])

    assert run({}) == {"tuned": True, "in_heap": True}
    assert run({allocator.ARENA_ENV: "8"}) == {"tuned": True, "in_heap": False}


# a fresh tuned process: 64 MiB of 1 MiB blocks freed stay in the heap (the trim threshold keeps
# them); release_free() hands their pages back, as the learner does once its start-up read is done
RELEASE = r"""
import json
from ddiloco_cli.learner import allocator
def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
allocator.tune()
blocks = [b"x" * (1 << 20) for _ in range(64)]
full = rss_mb()
del blocks
kept = rss_mb()
released = allocator.release_free()
print(json.dumps({"full": full, "kept": kept, "after": rss_mb(), "released": released}))
"""


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_release_free_hands_the_heaps_kept_pages_back():
    env = {k: v for k, v in os.environ.items() if k not in allocator.GLIBC_ENV and k != allocator.ENV_OPT_OUT}
    out = subprocess.run([sys.executable, "-c", RELEASE], env=env, capture_output=True, text=True, check=True,
                         timeout=120)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["released"] is True
    assert got["kept"] > got["full"] - 16  # freed, but kept by the heap
    assert got["kept"] - got["after"] > 48  # most of the 64 MiB back to the kernel
    assert allocator.release_free({allocator.ENV_OPT_OUT: "0"}) is False
