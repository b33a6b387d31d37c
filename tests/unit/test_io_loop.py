"""The S3 / GCS stores' event loop (ioloop.io_loop): one thread a process, and a forked
child gets a loop of its own (the parent's thread does not exist there: a request on the
parent's loop would never run)."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from ddiloco_cli.store.ioloop import io_loop


def _runs(loop: asyncio.AbstractEventLoop) -> bool:
    async def answer() -> int:
        return 42

    return asyncio.run_coroutine_threadsafe(answer(), loop).result(timeout=30) == 42


def test_one_loop_a_process_running_in_its_own_thread():
    loop = io_loop()
    assert io_loop() is loop and loop.is_running() and _runs(loop)


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin", reason="fork")
def test_a_forked_child_starts_a_loop_of_its_own():
    parent = io_loop()
    assert _runs(parent)
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if its loop is a new one and runs
        code = 1
        try:
            child = io_loop()
            code = 0 if child is not parent and _runs(child) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert io_loop() is parent and _runs(parent)  # the parent's is untouched
