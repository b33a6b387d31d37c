"""The event loop that every S3 and GCS store of a process runs its client on, in a daemon thread
of ddiloco's own, ``ddiloco-io`` (not fsspec's loop, which every fsspec filesystem of the process
shares). What the clients cost (s3fs about 2.5 ms of CPU a request, gcsfs about 0.5) is then
counted where it belongs, in a learner's cost report (``Store.io_threads``), and a training
script's own fsspec reads (a dataset streamed from a bucket) do not queue behind the learner's
uploads."""

from __future__ import annotations

import asyncio
import os
import threading

_io: dict[str, asyncio.AbstractEventLoop | threading.Thread | None] = {"loop": None, "thread": None}
_io_lock = threading.Lock()


def io_loop() -> asyncio.AbstractEventLoop:
    """The event loop the S3 and GCS stores of this process run their requests on, running in a
    daemon thread of its own, ``ddiloco-io`` (started on first use)."""
    with _io_lock:
        loop = _io["loop"]
        if loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="ddiloco-io", daemon=True)
            thread.start()
            _io.update(loop=loop, thread=thread)
        return loop  # type: ignore[return-value]


def io_thread() -> threading.Thread | None:
    """The loop's thread (None before the first store started it)."""
    thread = _io["thread"]
    return thread if isinstance(thread, threading.Thread) else None


def _forget_io_loop_after_fork() -> None:
    """A forked child has the parent's loop object but not its thread: it starts its own."""
    global _io_lock
    _io_lock = threading.Lock()
    _io.update(loop=None, thread=None)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_io_loop_after_fork)


