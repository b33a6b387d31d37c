"""The message channel between a learner and its io helper process: length-prefixed JSON
messages on a Unix socket pair (lists, numbers, strings and records; the fragments themselves
travel in shared blocks, ``slots``). JSON, not pickle: nothing in this package unpickles (PROTOCOL
[R5]), and these messages carry what the helper read from the bucket.

The learner's training thread sends a step's messages in one write (``post`` then ``flush``)
and reads what has come without waiting (``receive(0)``: one ``recv`` that does not block), so a
step with nothing to say costs one system call."""

from __future__ import annotations

import json
import select
import socket
import struct
import threading
from collections import deque
from typing import Any

_LEN = struct.Struct("!I")
MAX_MESSAGE = 64 << 20  # a frame longer than this is a broken channel, not a message


def _dumps(msg: Any) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


class Channel:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._in = bytearray()
        self._ready: deque = deque()
        self._out: list[bytes] = []
        self._send_lock = threading.Lock()  # the helper sends from several threads

    def fileno(self) -> int:
        return self.sock.fileno()

    def post(self, msg: Any) -> None:
        """Queue ``msg`` for the next ``flush`` (one thread only)."""
        body = _dumps(msg)
        self._out.append(_LEN.pack(len(body)) + body)

    def flush(self) -> None:
        if self._out:
            data, self._out = b"".join(self._out), []
            with self._send_lock:
                self.sock.sendall(data)

    def send(self, msg: Any) -> None:
        """``msg`` now (thread-safe against other ``send`` calls)."""
        body = _dumps(msg)
        with self._send_lock:
            self.sock.sendall(_LEN.pack(len(body)) + body)

    def receive(self, timeout: float | None) -> list[Any]:
        """The messages that have come; waits up to ``timeout`` seconds (None: for ever) for the
        first when none has. Raises EOFError once the other end has closed."""
        if not self._ready:
            self._read(socket.MSG_DONTWAIT)
            if not self._ready and timeout != 0:
                readable, _, _ = select.select([self.sock], [], [], timeout)
                if readable:
                    self._read(0)
        out = list(self._ready)
        self._ready.clear()
        return out

    def _read(self, flags: int) -> None:
        try:
            data = self.sock.recv(1 << 20, flags)
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            raise EOFError("the other end of the channel closed it")
        buf = self._in
        buf += data
        at = 0
        while len(buf) - at >= _LEN.size:
            (n,) = _LEN.unpack_from(buf, at)
            if n > MAX_MESSAGE:
                raise EOFError(f"a {n}-byte frame on the channel: broken")
            if len(buf) - at - _LEN.size < n:
                break
            self._ready.append(json.loads(bytes(buf[at + _LEN.size:at + _LEN.size + n])))
            at += _LEN.size + n
        del buf[:at]

    def close(self) -> None:
        self.sock.close()
