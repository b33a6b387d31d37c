"""A bucket in a local (or shared POSIX) directory.

Create-only writes: write the bytes to a temp file in the destination
directory, fsync, then ``os.link`` it to the final name, and fsync the
directory (a contribution: neither fsync, see below). ``link`` fails with ``FileExistsError`` if the name exists,
atomically, so exactly one writer wins and the final name only ever points at
a complete file. Overwrites use ``os.replace`` of a complete temp file, so
readers never see a torn object.

A learner's contribution skips both fsyncs (a learner writes one per step; the
two cost a third of its create): it is ephemeral, and the protocol tolerates
losing one (a learner crash loses its unsent ones too; the learner's next
contribution on the same base carries its progress; a replay that needs one
that is gone or differs from the ledger's sha256 continues as PROTOCOL [M4]
says). A host crash (power loss, kernel panic; a process crash is not one: the
kernel still writes its page cache out) may then lose its name, or leave it
torn under its name: empty, cut short, or with blocks of zeros. No reader
merges such a file: the decoder checks the safetensors header and offsets
against the file's length and every tensor's zstd frame (content size and
checksum) before it uses a byte (PROTOCOL.md, "Store requirements": [S9]),
so the syncer quarantines it as invalid. Everything else (the ledger's
manifests, published payloads, checkpoints, epochs, run.json) keeps both
fsyncs.

Temp files start with ``.tmp-`` and are never listed; a write that fails
removes its own, and ``remove_stale_temp`` removes those of writers that died.

Reads open with ``O_NONBLOCK | O_NOFOLLOW`` and check the open file with
``fstat`` before reading: a FIFO, device or symlink planted under an object's
name is refused at once instead of blocking or escaping the bucket, and a file
over the reader's bound is refused before a byte is read.

A full disk, a read-only remount and I/O errors are transient
(``TransientStoreError``: the retry policy backs off and tries again, an
operator may free space meanwhile); a permission error is a
``StoreAccessError``.
"""

from __future__ import annotations

import errno
import os
import stat
import time
import uuid
from typing import Callable, TypeVar

from ddiloco_cli.errors import StoreAccessError
from ddiloco_cli.protocol.layout import CONTRIBUTION_ROOT
from ddiloco_cli.store import TEMP_PREFIX, check_key
from ddiloco_cli.store.base import NotFound, ObjectInfo, ObjectTooLargeError, TransientStoreError, UnreadableObjectError

T = TypeVar("T")

# errors a retry may outlive: full disk or quota, read-only (re)mount, I/O and
# network-filesystem hiccups, descriptor exhaustion
_TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name) for name in ("ENOSPC", "EDQUOT", "EROFS", "EIO", "EAGAIN", "EBUSY", "EINTR", "ESTALE",
                                      "ETIMEDOUT", "ENFILE", "EMFILE", "ENOMEM") if hasattr(errno, name)
)
_ACCESS_ERRNOS = frozenset((errno.EACCES, errno.EPERM))
_READ_CHUNK_BYTES = 1 << 20
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)


class LocalStore:
    def __init__(self, root: str):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.url = self.root

    def _path(self, key: str) -> str:
        check_key(key)
        return os.path.join(self.root, *key.split("/"))

    def _os(self, fn: Callable[[], T], *, what: str) -> T:
        """Run ``fn``, mapping an OSError to the store's error classes (see the module docstring)."""
        try:
            return fn()
        except OSError as exc:
            if exc.errno in _TRANSIENT_ERRNOS:
                raise TransientStoreError(f"{what} in {self.root}: {exc}") from exc
            if exc.errno in _ACCESS_ERRNOS:
                raise StoreAccessError(f"{what} in {self.root} was refused ({exc}); check the directory's "
                                       "permissions") from exc
            raise

    def _write_temp(self, path: str, data: bytes, *, durable: bool = True) -> str:
        """A complete temp file beside ``path``, fsynced when ``durable``; on any failure none is left."""
        directory = os.path.dirname(path)
        tmp = os.path.join(directory, f"{TEMP_PREFIX}{uuid.uuid4().hex}")
        try:
            fd = os.open(tmp, _CREATE_FLAGS, 0o666)
        except FileNotFoundError:  # the directory's first object (most writes skip the mkdir)
            os.makedirs(directory, exist_ok=True)
            fd = os.open(tmp, _CREATE_FLAGS, 0o666)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        except BaseException:
            _discard(tmp)
            raise
        finally:
            os.close(fd)
        return tmp

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        return self._os(lambda: self._create(key, path, data), what=f"create {key}")

    def _create(self, key: str, path: str, data: bytes) -> bool:
        durable = not key.startswith(CONTRIBUTION_ROOT)  # see the module docstring
        tmp = self._write_temp(path, data, durable=durable)
        try:
            while True:
                try:
                    os.link(tmp, path)
                    if durable:
                        _fsync_dir(os.path.dirname(path))
                    return True
                except FileExistsError:
                    pass
                try:
                    return self._read(key, path, max_bytes=len(data)) == data
                except UnreadableObjectError:  # larger than ours, or not a file: not ours
                    return False
                except NotFound:  # deleted between link and read: try again
                    continue
        finally:
            _discard(tmp)

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)

        def replace() -> None:
            tmp = self._write_temp(path, data)
            try:
                os.replace(tmp, path)
            except BaseException:
                _discard(tmp)
                raise
            _fsync_dir(os.path.dirname(path))

        self._os(replace, what=f"put {key}")

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        path = self._path(key)
        return self._os(lambda: self._read(key, path, max_bytes=max_bytes), what=f"get {key}")

    def _read(self, key: str, path: str, *, max_bytes: int | None) -> bytes:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise NotFound(key) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
                raise UnreadableObjectError(f"{key}: is a symbolic link, not an object; not read") from None
            raise
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise NotFound(key)
            if not stat.S_ISREG(st.st_mode):
                raise UnreadableObjectError(f"{key}: is not a regular file (mode {stat.filemode(st.st_mode)}); "
                                            "not read")
            if max_bytes is not None and st.st_size > max_bytes:
                raise ObjectTooLargeError(key, size=st.st_size, max_bytes=max_bytes)
            # read at most one byte past the bound: the file may grow after fstat
            left = None if max_bytes is None else max_bytes + 1
            chunks = []
            while left is None or left > 0:
                chunk = os.read(fd, _READ_CHUNK_BYTES if left is None else min(left, _READ_CHUNK_BYTES))
                if not chunk:
                    break
                chunks.append(chunk)
                if left is not None:
                    left -= len(chunk)
        finally:
            os.close(fd)
        data = b"".join(chunks)
        if max_bytes is not None and len(data) > max_bytes:
            raise ObjectTooLargeError(key, size=None, max_bytes=max_bytes)
        return data

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return self._os(lambda: self._walk(prefix, temp=False), what=f"list {prefix!r}")

    def _walk(self, prefix: str, *, temp: bool) -> list[ObjectInfo]:
        """Objects under ``prefix`` (``temp=False``) or the temp files anywhere (``temp=True``)."""
        # walk only the deepest directory the prefix pins down
        start_dir = prefix.rpartition("/")[0]
        top = os.path.join(self.root, *start_dir.split("/")) if start_dir else self.root
        out = []
        for dirpath, _, filenames in os.walk(top):
            rel_dir = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            for name in filenames:
                if name.startswith(TEMP_PREFIX) != temp:
                    continue
                key = name if rel_dir == "." else f"{rel_dir}/{name}"
                if not key.startswith(prefix):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:  # deleted while we walked
                    continue
                out.append(ObjectInfo(key=key, size=st.st_size, mtime_s=st.st_mtime))
        out.sort(key=lambda o: o.key)
        return out

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            self._os(lambda: os.unlink(path), what=f"delete {key}")
        except FileNotFoundError:
            pass

    def remove_stale_temp(self, *, older_than_s: float, dry_run: bool = False) -> list[ObjectInfo]:
        """Delete ``.tmp-*`` files last modified more than ``older_than_s`` ago (a
        live writer's temp file is younger: it lives for one write)."""
        assert older_than_s > 0, older_than_s
        now_s = time.time()
        stale = [t for t in self._os(lambda: self._walk("", temp=True), what="list temp files")
                 if now_s - t.mtime_s > older_than_s]
        if not dry_run:
            for t in stale:
                self._os(lambda t=t: _unlink_quietly(os.path.join(self.root, *t.key.split("/"))),
                         what=f"delete {t.key}")
        return stale

    def now(self) -> float:
        return time.time()


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _discard(tmp: str) -> None:
    """Best-effort removal of our own temp file after a write (a failure here must
    not mask the write's outcome; ``remove_stale_temp`` catches what remains)."""
    try:
        os.unlink(tmp)
    except OSError:
        pass


def _fsync_dir(directory: str) -> None:
    """Make a new directory entry durable (POSIX); best effort elsewhere."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
