"""S3 and GCS buckets through s3fs / gcsfs.

Create-only writes map to the services' own preconditions:

* S3: ``PUT`` with ``If-None-Match: *`` (``s3fs.pipe_file(mode="create")``).
  We always send one ``PUT`` (S3 allows up to 5 GiB per PUT); above that
  s3fs switches to a multipart upload and sends the condition on
  ``CompleteMultipartUpload``, which AWS honours but moto does not check.
* GCS: ``ifGenerationMatch=0`` (``gcsfs.pipe_file(mode="create")``). We force
  gcsfs's single-request multipart upload for any size (its default switches
  to a resumable upload at 50 MiB; fake-gcs-server ignores the precondition
  there). A single-request upload holds the body twice in memory.

Both clients retry on their own, so a create that won can come back as a
conflict (our own earlier attempt is the existing object). ``put_if_absent``
settles that by reading the object back and comparing bytes.

Listings never come from a cache (``use_listings_cache=False``) and every
store gets its own filesystem instance (``skip_instance_cache=True``).
Object times (``ObjectInfo.mtime_s``, ``now()``) are the service's clock:
S3 ``LastModified`` (whole seconds), GCS ``updated`` (microseconds).
"""

from __future__ import annotations

import datetime as dt
import errno
import os
import time
import uuid
from typing import Callable, TypeVar

from ddiloco_cli import layout
from ddiloco_cli.errors import StoreAccessError
from ddiloco_cli.store import check_key
from ddiloco_cli.store.base import NotFound, ObjectInfo, TransientStoreError, retrying

# gcsfs otherwise probes every bucket for zonal/HNS support, which hangs ~60 s per
# write against emulators. Must be set before gcsfs is imported.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

T = TypeVar("T")

_S3_SINGLE_PUT_MAX_BYTES = 5 * 2**30
_GCS_DEFAULT_CHUNK_BYTES = 50 * 2**20


class _FsspecStore:
    """Shared logic; subclasses build the filesystem and classify errors."""

    scheme = ""

    def __init__(self, bucket: str, prefix: str, *, fs, endpoint: str | None):
        self.bucket = bucket
        self.prefix = prefix
        self.root = f"{bucket}/{prefix}" if prefix else bucket
        self.url = f"{self.scheme}://{self.root}"
        self.endpoint = endpoint
        self._fs = fs
        self._check_access()

    # -- subclass hooks ----------------------------------------------------
    def _is_transient(self, exc: BaseException) -> bool:
        raise NotImplementedError

    def _is_access_error(self, exc: BaseException) -> bool:
        raise NotImplementedError

    def _create(self, path: str, data: bytes) -> None:
        raise NotImplementedError

    def _probe_bucket(self) -> None:
        raise NotImplementedError

    @staticmethod
    def _mtime_s(info: dict) -> float:
        raise NotImplementedError

    # -- plumbing ----------------------------------------------------------
    def _where(self) -> str:
        return f"{self.url} (endpoint {self.endpoint})" if self.endpoint else self.url

    def _call(self, fn: Callable[[], T], *, what: str, attempts: int = 6) -> T:
        """Run one client call: transient failures retried, access errors mapped to
        ``StoreAccessError``, ``FileNotFoundError``/``FileExistsError`` passed on."""

        def attempt() -> T:
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

        return retrying(attempt, what=f"{what} on {self.url}", attempts=attempts)

    def _check_access(self) -> None:
        try:
            self._call(self._probe_bucket, what="list", attempts=1)  # the clients retry inside
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
                return self.get(key) == data
            except NotFound:  # deleted between the conflict and the read: try again
                continue

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        self._call(lambda: self._fs.pipe_file(path, bytes(data)), what=f"put {key}")

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return self._call(lambda: self._fs.cat_file(path), what=f"get {key}")
        except FileNotFoundError:
            raise NotFound(key) from None

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        # list recursively under the deepest "directory" the prefix pins down,
        # then filter exactly on the full prefix
        start_dir = prefix.rpartition("/")[0]
        base = f"{self.root}/{start_dir}" if start_dir else self.root
        full_prefix = f"{self.root}/{prefix}"
        try:
            found = self._call(lambda: self._fs.find(base, detail=True), what=f"list {prefix!r}")
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


class S3Store(_FsspecStore):
    scheme = "s3"

    def __init__(self, bucket: str, prefix: str, *, options: dict | None = None):
        import s3fs

        opts = dict(options or {})
        endpoint = (
            opts.pop("endpoint_url", None)
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
        )
        client_kwargs = dict(opts.pop("client_kwargs", None) or {})
        region = opts.pop("region_name", None) or opts.pop("region", None)
        if region:
            client_kwargs["region_name"] = region
        fs = s3fs.S3FileSystem(
            endpoint_url=endpoint,
            client_kwargs=client_kwargs,
            use_listings_cache=False,
            skip_instance_cache=True,
            **opts,
        )
        super().__init__(bucket, prefix, fs=fs, endpoint=endpoint)

    def _probe_bucket(self) -> None:
        kw = {"Prefix": self.prefix + "/"} if self.prefix else {}
        self._fs.call_s3("list_objects_v2", Bucket=self.bucket, MaxKeys=1, **kw)

    def _create(self, path: str, data: bytes) -> None:
        # chunksize chosen so that s3fs sends a single conditional PUT up to 5 GiB
        chunksize = max(50 * 2**20, min(len(data), _S3_SINGLE_PUT_MAX_BYTES) // 2 + 1)
        self._fs.pipe_file(path, data, mode="create", chunksize=chunksize)

    def _is_access_error(self, exc: BaseException) -> bool:
        import botocore.exceptions as bce

        return isinstance(exc, (PermissionError, bce.NoCredentialsError, bce.PartialCredentialsError))

    def _is_transient(self, exc: BaseException) -> bool:
        import botocore.exceptions as bce

        if isinstance(exc, (TimeoutError, ConnectionError, bce.HTTPClientError, bce.ConnectionError)):
            return True
        if _is_aiohttp_error(exc):
            return True
        if isinstance(exc, OSError) and exc.errno in (errno.EBUSY, getattr(errno, "EREMOTEIO", errno.EIO)):
            return True
        status = _s3_status(exc.__cause__)
        return status == 429 or (status is not None and status >= 500)

    @staticmethod
    def _mtime_s(info: dict) -> float:
        return _to_epoch_s(info["LastModified"])


class GCSStore(_FsspecStore):
    scheme = "gs"

    def __init__(self, bucket: str, prefix: str, *, options: dict | None = None):
        import gcsfs

        opts = dict(options or {})
        endpoint = opts.pop("endpoint_url", None) or os.environ.get("STORAGE_EMULATOR_HOST") or None
        if endpoint and "://" not in endpoint:
            endpoint = f"http://{endpoint}"
        if opts.pop("anon", False) or (endpoint and "token" not in opts):
            opts["token"] = "anon"  # emulators take no credentials
        fs = gcsfs.GCSFileSystem(
            endpoint_url=endpoint,
            use_listings_cache=False,
            skip_instance_cache=True,
            **opts,
        )
        super().__init__(bucket, prefix, fs=fs, endpoint=endpoint)

    def _probe_bucket(self) -> None:
        kw = {"prefix": self.prefix + "/"} if self.prefix else {}
        self._fs.call("GET", "b/{}/o", self.bucket, maxResults=1, json_out=True, **kw)

    def _create(self, path: str, data: bytes) -> None:
        # single-request upload for any size: ifGenerationMatch=0 rides on it
        chunksize = max(_GCS_DEFAULT_CHUNK_BYTES, len(data) + 1)
        self._fs.pipe_file(path, data, mode="create", chunksize=chunksize)

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


def _to_epoch_s(value) -> float:
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.timezone.utc)
    return value.timestamp()


def _s3_status(exc: BaseException | None) -> int | None:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    return response.get("ResponseMetadata", {}).get("HTTPStatusCode")


def _is_aiohttp_error(exc: BaseException) -> bool:
    try:
        import aiohttp
    except ImportError:
        return False
    return isinstance(exc, aiohttp.ClientError)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
