"""S3 buckets: s3fs for every call, except GETs and PUTs, which take the lean path of
``s3fast.py`` where it applies (s3fs is then its fallback). What S3 and GCS share, and the
service-level details (create-only PUTs with ``If-None-Match: *``, no ``Expect: 100-continue``,
timeouts, the retry policy), is in ``fsspec_store.py``."""

from __future__ import annotations

import errno
import logging
import os

from ddiloco_cli.store import s3fast
from ddiloco_cli.store.fsspec_store import (
    _FsspecStore,
    _is_aiohttp_error,
    _one_line,
    _pop_timeouts,
    _to_epoch_s,
)
from ddiloco_cli.store.ioloop import io_loop
from ddiloco_cli.store.retry import DEFAULT_POLICY, RetryPolicy

log = logging.getLogger(__name__)

_S3_SINGLE_PUT_MAX_BYTES = 5 * 2**30
_S3FS = object()  # _via_fast's answer when s3fs is to make the call


class S3Store(_FsspecStore):
    scheme = "s3"

    def __init__(self, bucket: str, prefix: str, *, options: dict | None = None,
                 policy: RetryPolicy = DEFAULT_POLICY):
        import s3fs
        from aiobotocore.session import AioSession
        from botocore.handlers import add_expect_header

        opts = dict(options or {})
        connect_timeout_s, read_timeout_s = _pop_timeouts(opts)
        fast = opts.pop("fast_requests", True)
        session = AioSession()
        if not opts.pop("expect_100_continue", False):
            session.unregister("before-call.s3", add_expect_header)
        user_config = dict(opts.pop("config_kwargs", None) or {})
        config_kwargs = {**user_config, "connect_timeout": connect_timeout_s,
                         "read_timeout": read_timeout_s, "retries": {"total_max_attempts": 1}}
        endpoint = (
            opts.pop("endpoint_url", None)
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
        )
        client_kwargs = dict(opts.pop("client_kwargs", None) or {})
        # the fast path (s3fast.py) only where s3fs would do nothing it does not: no client or
        # config options of the user's own, no s3fs option but credentials
        fast_ok, fast_why = s3fast.wanted([*(k for k in opts if k not in ("region_name", "region")),
                                           *(["config_kwargs"] if user_config else []),
                                           *(["client_kwargs"] if client_kwargs else [])])
        if not _true(fast):
            fast_ok, fast_why = False, "fast_requests=false"
        region = opts.pop("region_name", None) or opts.pop("region", None)
        if region:
            client_kwargs["region_name"] = region
        fs = s3fs.S3FileSystem(
            endpoint_url=endpoint,
            client_kwargs=client_kwargs,
            config_kwargs=config_kwargs,
            session=session,
            loop=io_loop(),
            use_listings_cache=False,
            skip_instance_cache=True,
            **opts,
        )
        fs.retries = 1  # s3fs's own retry loop (a class attribute, not an init option): one attempt
        self._fast: s3fast.FastS3 | None = None
        super().__init__(bucket, prefix, fs=fs, endpoint=endpoint, policy=policy)
        if fast_ok:
            try:
                self._fast = s3fast.from_s3fs(fs, bucket, options=opts, loop=io_loop(),
                                              connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s)
            except Exception as exc:  # noqa: BLE001 - s3fs serves every call then
                fast_why = _one_line(exc)
        if self._fast is None:
            log.debug("%s: every request through s3fs (%s)", self.url, fast_why)

    def _object_key(self, path: str) -> str:
        return path[len(self.bucket) + 1 :]

    def _via_fast(self, call):
        """``call(fast path)``'s answer, or _S3FS when s3fs is to make the call: the path is off,
        or it got an answer it does not expect, which turns it off for this store from now on."""
        fast = self._fast  # (another thread may turn it off meanwhile)
        if fast is None:
            return _S3FS
        try:
            return call(fast)
        except s3fast.Unexpected as exc:
            if self._fast is not None:
                log.warning("%s: %s; making every request through s3fs from now on", self._where(), exc)
                self._fast = None
            return _S3FS

    def _read(self, path: str, max_bytes: int | None) -> bytes:
        got = self._via_fast(lambda fast: fast.get(self._object_key(path), max_bytes))
        return super()._read(path, max_bytes) if got is _S3FS else got

    def _write(self, path: str, data: bytes) -> None:
        if self._via_fast(lambda fast: fast.put(self._object_key(path), data, create=False)) is _S3FS:
            super()._write(path, data)

    def _probe_bucket(self) -> None:
        kw = {"Prefix": self.prefix + "/"} if self.prefix else {}
        self._fs.call_s3("list_objects_v2", Bucket=self.bucket, MaxKeys=1, **kw)

    def _create(self, path: str, data: bytes) -> None:
        if len(data) <= _S3_SINGLE_PUT_MAX_BYTES:
            created = self._via_fast(lambda fast: fast.put(self._object_key(path), data, create=True))
            if created is False:
                raise FileExistsError(path)
            if created is True:
                return
        # chunksize chosen so that s3fs sends a single conditional PUT up to 5 GiB
        chunksize = max(50 * 2**20, min(len(data), _S3_SINGLE_PUT_MAX_BYTES) // 2 + 1)
        self._fs.pipe_file(path, data, mode="create", chunksize=chunksize)

    def _is_empty_range(self, exc: BaseException) -> bool:
        return _s3_status(exc.__cause__) == 416 or "InvalidRange" in str(getattr(exc.__cause__, "response", ""))

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



def _s3_status(exc: BaseException | None) -> int | None:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    return response.get("ResponseMetadata", {}).get("HTTPStatusCode")



def _true(value) -> bool:
    """A storage option's truth (``-o name=false`` may arrive as the string)."""
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no", "off")
    return bool(value)


