"""A bucket in a local (or shared POSIX) directory.

Create-only writes: write the bytes to a temp file in the destination
directory, fsync, then ``os.link`` it to the final name. ``link`` fails with
``FileExistsError`` if the name exists, atomically, so exactly one writer wins
and the final name only ever points at a complete file. Overwrites use
``os.replace`` of a complete temp file, so readers never see a torn object.
Temp files start with ``.tmp-`` and are never listed.
"""

from __future__ import annotations

import os
import time
import uuid

from ddiloco_cli.store import TEMP_PREFIX, check_key
from ddiloco_cli.store.base import NotFound, ObjectInfo


class LocalStore:
    def __init__(self, root: str):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.url = self.root

    def _path(self, key: str) -> str:
        check_key(key)
        return os.path.join(self.root, *key.split("/"))

    def _write_temp(self, path: str, data: bytes) -> str:
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f"{TEMP_PREFIX}{uuid.uuid4().hex}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        tmp = self._write_temp(path, data)
        try:
            while True:
                try:
                    os.link(tmp, path)
                    _fsync_dir(os.path.dirname(path))
                    return True
                except FileExistsError:
                    pass
                try:
                    return self.get(key) == data
                except NotFound:  # deleted between link and read: try again
                    continue
        finally:
            os.unlink(tmp)

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = self._write_temp(path, data)
        try:
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        _fsync_dir(os.path.dirname(path))

    def get(self, key: str) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise NotFound(key) from None

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        # walk only the deepest directory the prefix pins down
        start_dir = prefix.rpartition("/")[0]
        top = os.path.join(self.root, *start_dir.split("/")) if start_dir else self.root
        out = []
        for dirpath, _, filenames in os.walk(top):
            rel_dir = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            for name in filenames:
                if name.startswith(TEMP_PREFIX):
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
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass

    def now(self) -> float:
        return time.time()


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
