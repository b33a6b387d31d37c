"""S3 and GCS buckets through s3fs / gcsfs: the logic both share, and the GCS store.

Create-only writes map to the services' own preconditions:

* S3: ``PUT`` with ``If-None-Match: *`` (``s3fs.pipe_file(mode="create")``).
  We always send one ``PUT`` (S3 allows up to 5 GiB per PUT); above that
  s3fs switches to a multipart upload and sends the condition on
  ``CompleteMultipartUpload``, which AWS honours but moto does not check.
* GCS: ``ifGenerationMatch=0`` (``gcsfs.pipe_file(mode="create")``). We force
  gcsfs's single-request multipart upload for any size (its default switches
  to a resumable upload at 50 MiB; fake-gcs-server ignores the precondition
  there). A single-request upload holds the body twice in memory.

The clients do not retry (botocore and s3fs are set to one attempt, gcsfs's
request retry loop is cut to one): ``RetryingStore`` retries whole calls under
the one policy of ``store/retry.py``. A create whose response was lost comes
back as a conflict on retry (our own earlier attempt is the existing object);
``put_if_absent`` settles that by reading the object back and comparing bytes.

Every request has a connect and a read timeout (storage options
``connect_timeout_s``, default 10, and ``read_timeout_s``, default 20), so an
endpoint that accepts connections and never answers fails a call in tens of
seconds, not minutes. Bounded reads (``get(key, max_bytes=N)``) are one ranged
GET of at most N + 1 bytes.

S3 PUTs are sent without ``Expect: 100-continue`` (botocore adds it to every
PUT with a body; it costs a round trip per PUT and our bodies are small enough
to send at once). ``-o expect_100_continue=true`` restores it.

Listings never come from a cache (``use_listings_cache=False``) and every
store gets its own filesystem instance (``skip_instance_cache=True``).

The requests of every S3 and GCS store in a process run on one event loop of
ddiloco's own (``ioloop.py``). The S3 store (``s3_store.py``) makes its GETs and
PUTs on a leaner path on the calling thread (``s3fast.py``).

Object times (``ObjectInfo.mtime_s``, ``now()``) are the service's clock:
S3 ``LastModified`` (whole seconds), GCS ``updated`` (microseconds).
"""

from __future__ import annotations

import datetime as dt
import os
import threading
import time
import uuid
from typing import Callable, TypeVar

from ddiloco_cli.errors import StoreAccessError, UsageError
from ddiloco_cli.protocol import layout
from ddiloco_cli.store import check_key
from ddiloco_cli.store.base import NotFound, ObjectInfo, ObjectTooLargeError, TransientStoreError, UnreadableObjectError
from ddiloco_cli.store.ioloop import io_loop, io_thread
from ddiloco_cli.store.retry import DEFAULT_POLICY, RetryPolicy, retrying

# gcsfs otherwise probes every bucket for zonal/HNS support, which hangs ~60 s per
# write against emulators. Must be set before gcsfs is imported.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

T = TypeVar("T")

_GCS_DEFAULT_CHUNK_BYTES = 50 * 2**20
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_READ_TIMEOUT_S = 20.0


def _pop_timeouts(opts: dict) -> tuple[float, float]:
    """(connect_timeout_s, read_timeout_s) from the storage options (removed from them)."""
    out = []
    for name, default in (("connect_timeout_s", DEFAULT_CONNECT_TIMEOUT_S), ("read_timeout_s", DEFAULT_READ_TIMEOUT_S)):
        value = opts.pop(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise UsageError(f"storage option {name}={value!r} must be a positive number of seconds")
        out.append(float(value))
    return out[0], out[1]


class _FsspecStore:
    """Shared logic; subclasses build the filesystem and classify errors."""

    scheme = ""

    def __init__(self, bucket: str, prefix: str, *, fs, endpoint: str | None, policy: RetryPolicy):
        self.bucket = bucket
        self.prefix = prefix
        self.root = f"{bucket}/{prefix}" if prefix else bucket
        self.url = f"{self.scheme}://{self.root}"
        self.endpoint = endpoint
        self._fs = fs
        self._check_access(policy)

    # -- subclass hooks ----------------------------------------------------
    def _is_transient(self, exc: BaseException) -> bool:
        raise NotImplementedError

    def _is_access_error(self, exc: BaseException) -> bool:
        raise NotImplementedError

    def _create(self, path: str, data: bytes) -> None:
        raise NotImplementedError

    def _is_empty_range(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the service's 416 for a ranged read of an empty object."""
        raise NotImplementedError

    def _probe_bucket(self) -> None:
        raise NotImplementedError

    @staticmethod
    def _mtime_s(info: dict) -> float:
        raise NotImplementedError

    def io_threads(self) -> list[threading.Thread]:
        """The threads that make this store's requests (the calling thread only waits for them):
        ``ddiloco-io``, shared by every S3 and GCS store of the process."""
        thread = io_thread()
        return [thread] if thread is not None and thread.is_alive() else []

    # -- plumbing ----------------------------------------------------------
    def _where(self) -> str:
        return f"{self.url} (endpoint {self.endpoint})" if self.endpoint else self.url

    def _call(self, fn: Callable[[], T], *, what: str) -> T:
        """Run one client call: transient failures raised as ``TransientStoreError``
        (the retry policy is the caller's), access errors as ``StoreAccessError``,
        ``FileNotFoundError``/``FileExistsError`` passed on."""
        try:
            return fn()
        except (FileNotFoundError, FileExistsError):
            raise
        except Exception as exc:
            if self._is_access_error(exc):
                raise StoreAccessError(
                    f"{self._where()}: {what} was refused ({_one_line(exc)}); "
                    "check the credentials and the bucket's permissions"
                ) from exc
            if self._is_transient(exc):
                raise TransientStoreError(f"{what}: {_one_line(exc)}") from exc
            raise

    def _check_access(self, policy: RetryPolicy) -> None:
        try:
            retrying(lambda: self._call(self._probe_bucket, what="list"), what=f"open {self.url}", policy=policy)
        except FileNotFoundError:
            raise StoreAccessError(
                f"bucket {self.bucket!r} does not exist at {self._where()}; create it or fix the URL"
            ) from None
        except TransientStoreError as exc:
            raise StoreAccessError(f"cannot reach {self._where()}: {exc}") from exc
        except StoreAccessError:
            raise
        except Exception as exc:  # bad endpoint URL, no credentials, ...
            raise StoreAccessError(f"cannot open {self._where()}: {_one_line(exc)}") from exc

    def _path(self, key: str) -> str:
        check_key(key)
        return f"{self.root}/{key}"

    # -- the Store interface ---------------------------------------------------
    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        data = bytes(data)
        while True:
            try:
                self._call(lambda: self._create(path, data), what=f"create {key}")
                return True
            except FileExistsError:
                pass
            try:
                return self.get(key, max_bytes=len(data)) == data
            except UnreadableObjectError:  # larger than ours: not ours
                return False
            except NotFound:  # deleted between the conflict and the read: try again
                continue

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        self._call(lambda: self._write(path, bytes(data)), what=f"put {key}")

    def _write(self, path: str, data: bytes) -> None:
        self._fs.pipe_file(path, data)

    def _read(self, path: str, max_bytes: int | None) -> bytes:
        if max_bytes is None:
            return self._fs.cat_file(path)
        # one ranged GET of at most max_bytes + 1 bytes: enough to tell "too large"
        return self._fs.cat_file(path, start=0, end=max_bytes + 1)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        path = self._path(key)
        try:
            data = self._call(lambda: self._read(path, max_bytes), what=f"get {key}")
        except FileNotFoundError:
            raise NotFound(key) from None
        except Exception as exc:
            if max_bytes is not None and self._is_empty_range(exc):
                return b""
            raise
        if max_bytes is not None and len(data) > max_bytes:
            raise ObjectTooLargeError(key, size=self._size_or_none(path), max_bytes=max_bytes)
        return data

    def _size_or_none(self, path: str) -> int | None:
        """The object's size for an error message; None if it cannot be had."""
        try:
            return int(self._fs.info(path)["size"])
        except Exception:  # noqa: BLE001 - only decorates a message
            return None

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        # one recursive listing of the objects under root/prefix, filtered exactly on it;
        # the prefix goes to find() as such: s3fs asks no more (its HEAD and second LIST
        # to tell an empty directory from a file) when a listing with a prefix is empty
        full_prefix = f"{self.root}/{prefix}"
        try:
            found = self._call(lambda: self._fs.find(self.root, detail=True, prefix=prefix),
                               what=f"list {prefix!r}")
        except FileNotFoundError:
            return []
        out = []
        for name, info in found.items():
            if info.get("type") != "file" or name.endswith("/") or not name.startswith(full_prefix):
                continue
            out.append(
                ObjectInfo(key=name[len(self.root) + 1 :], size=int(info["size"]), mtime_s=self._mtime_s(info))
            )
        out.sort(key=lambda o: o.key)
        return out

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            self._call(lambda: self._fs.rm_file(path), what=f"delete {key}")
        except FileNotFoundError:
            pass

    def remove_stale_temp(self, *, older_than_s: float, dry_run: bool = False) -> list[ObjectInfo]:
        # a single-request upload either creates the whole object or nothing
        return []

    # Re-read the service's clock this often; in between, advance it by the local
    # monotonic clock (immune to wall-clock jumps; only its rate is trusted).
    CLOCK_PROBE_EVERY_S = 30.0

    def now(self) -> float:
        """The service's clock. Probing it costs three requests (write a tiny
        object, read its modification time, delete it), so a probe is reused
        for CLOCK_PROBE_EVERY_S, advanced by ``time.monotonic()``."""
        probe = getattr(self, "_clock", None)
        if probe is not None and time.monotonic() - probe[1] < self.CLOCK_PROBE_EVERY_S:
            return probe[0] + (time.monotonic() - probe[1])
        key = f"{layout.CLOCK_PREFIX}{uuid.uuid4().hex}"
        path = self._path(key)
        t0 = time.monotonic()
        self._call(lambda: self._fs.pipe_file(path, b""), what="clock probe")
        try:
            info = self._call(lambda: self._fs.info(path), what="clock probe")
        finally:
            self.delete(key)
        store_s = self._mtime_s(info)
        self._clock = (store_s, t0)  # the object was stamped at or after t0
        return store_s + (time.monotonic() - t0)


class GCSStore(_FsspecStore):
    scheme = "gs"

    def __init__(self, bucket: str, prefix: str, *, options: dict | None = None,
                 policy: RetryPolicy = DEFAULT_POLICY):
        import aiohttp

        opts = dict(options or {})
        connect_timeout_s, read_timeout_s = _pop_timeouts(opts)
        endpoint = opts.pop("endpoint_url", None) or os.environ.get("STORAGE_EMULATOR_HOST") or None
        if endpoint and "://" not in endpoint:
            endpoint = f"http://{endpoint}"
        if opts.pop("anon", False) or (endpoint and "token" not in opts):
            opts["token"] = "anon"  # emulators take no credentials
        fs = _single_attempt_gcsfs()(
            endpoint_url=endpoint,
            requests_timeout=aiohttp.ClientTimeout(sock_connect=connect_timeout_s, sock_read=read_timeout_s),
            loop=io_loop(),
            use_listings_cache=False,
            skip_instance_cache=True,
            **opts,
        )
        super().__init__(bucket, prefix, fs=fs, endpoint=endpoint, policy=policy)

    def _probe_bucket(self) -> None:
        kw = {"prefix": self.prefix + "/"} if self.prefix else {}
        self._fs.call("GET", "b/{}/o", self.bucket, maxResults=1, json_out=True, **kw)

    def _create(self, path: str, data: bytes) -> None:
        # single-request upload for any size: ifGenerationMatch=0 rides on it
        chunksize = max(_GCS_DEFAULT_CHUNK_BYTES, len(data) + 1)
        self._fs.pipe_file(path, data, mode="create", chunksize=chunksize)

    def _is_empty_range(self, exc: BaseException) -> bool:
        from gcsfs.retry import HttpError

        return isinstance(exc, HttpError) and exc.code == 416

    def _is_access_error(self, exc: BaseException) -> bool:
        from gcsfs.retry import HttpError

        if isinstance(exc, HttpError) and exc.code in (401, 403):
            return True
        if type(exc) is OSError and str(exc).startswith("Forbidden"):
            return True
        return type(exc).__name__ in ("DefaultCredentialsError", "RefreshError")

    def _is_transient(self, exc: BaseException) -> bool:
        from gcsfs.retry import is_retriable

        if isinstance(exc, (TimeoutError, ConnectionError)) or _is_aiohttp_error(exc):
            return True
        return is_retriable(exc)

    @staticmethod
    def _mtime_s(info: dict) -> float:
        if isinstance(info.get("mtime"), dt.datetime):
            return info["mtime"].timestamp()
        return _to_epoch_s(info["updated"])


_GCSFS_CLASS = None


def _single_attempt_gcsfs():
    """``gcsfs.GCSFileSystem`` with its request retry loop cut to one attempt (its
    count is fixed when gcsfs defines the class), so our policy is the only one."""
    global _GCSFS_CLASS
    if _GCSFS_CLASS is None:
        _quiet_google_loggers()
        import gcsfs
        from gcsfs.retry import retry_request

        class SingleAttemptGCSFileSystem(gcsfs.GCSFileSystem):
            _request = retry_request(retries=1)(gcsfs.GCSFileSystem._request.__wrapped__)

        _GCSFS_CLASS = SingleAttemptGCSFileSystem
    return _GCSFS_CLASS


def _quiet_google_loggers() -> None:
    """gcsfs logs every failed request with its traceback (``logger.exception``) and
    google.auth warns on each metadata-server probe; our error already says what failed
    in one line, as for S3. GCSFS_DEBUG (gcsfs's own switch) keeps them."""
    import logging

    if os.environ.get("GCSFS_DEBUG"):
        return
    logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
    logging.getLogger("google.auth").setLevel(logging.ERROR)
    logging.getLogger("google.auth.compute_engine").setLevel(logging.CRITICAL)


def _to_epoch_s(value) -> float:
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.timezone.utc)
    return value.timestamp()


def _is_aiohttp_error(exc: BaseException) -> bool:
    try:
        import aiohttp
    except ImportError:
        return False
    return isinstance(exc, aiohttp.ClientError)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
