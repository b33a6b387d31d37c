"""A lean request path for the S3 store's frequent calls: GET (whole or ranged), PUT and the
create-only PUT (``If-None-Match: *``), made on the calling thread, signed by our own SigV4 signer
(store/sigv4.py: botocore's signature, its signing key derived once a day) and sent on a pool of
urllib3 keep-alive connections.

Through s3fs and aiobotocore each request costs the client about 2.6 ms of CPU (against a local
moto server; boto3's synchronous client 1.8-1.9 ms), so on a learner, which makes about four a
step, the client cost more than everything else ddiloco does (docs/results.md, "Learner
overhead"); this path costs about a third of that. Everything else (LIST, DELETE, the clock
probe, a listing's HEAD) stays on s3fs.

It takes the addressing and the signing region from s3fs's own client (a presigned URL of a
probe key: virtual-hosted or path style, custom endpoint, the region botocore chose), and the
credentials from botocore's default chain or the store's ``key`` / ``secret`` / ``token`` /
``profile`` options. It is used only where it can do exactly what s3fs would: not with other s3fs
options (anonymous access, server-side encryption headers, requester pays, another signature
version), not behind a proxy named in the environment, and not with ``-o fast_requests=false``
or ``DDILOCO_S3_FAST=0``. Any answer it does not expect (a redirect to another region, an error
it cannot classify, a refused signature) turns it off for the store's lifetime with a warning,
and the call is made again through s3fs, which then decides: never worse than s3fs alone."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import quote, urlsplit

from ddiloco_cli.store.base import TransientStoreError
from ddiloco_cli.store.sigv4 import Signer, host_header

ENV_OFF = "DDILOCO_S3_FAST"
PROBE_KEY = "ddiloco-addressing-probe"
# the s3fs options this path understands; any other one (encryption headers, requester pays,
# a config of its own) makes the store use s3fs alone
CREDENTIAL_OPTIONS = ("key", "secret", "token", "profile")
PROXY_ENV = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy")


class Unexpected(Exception):
    """An answer this path does not handle: the store turns it off and asks s3fs."""


def wanted(options: Iterable[str], environ: Mapping[str, str] = os.environ) -> tuple[bool, str]:
    """Whether the fast path may serve a store opened with the s3fs options named (those left
    for s3fs); why not when not."""
    if environ.get(ENV_OFF, "1").strip().lower() in ("0", "false", "no", "off"):
        return False, f"{ENV_OFF}={environ[ENV_OFF]}"
    other = sorted(k for k in options if k not in CREDENTIAL_OPTIONS)
    if other:
        return False, f"s3fs options {', '.join(other)}"
    proxies = [k for k in PROXY_ENV if environ.get(k)]
    if proxies:
        return False, f"a proxy in the environment ({proxies[0]})"
    return True, ""


class FastS3:
    """GET and PUT of one bucket's objects. ``base_url``: the URL of an object is this plus its
    key, percent-encoded as botocore encodes keys."""

    def __init__(self, *, base_url: str, region: str, credentials: Any, connect_timeout_s: float,
                 read_timeout_s: float):
        import urllib3
        from botocore.httpsession import get_cert_path

        self.base_url = base_url
        parts = urlsplit(base_url)
        self._host, self._base_path = host_header(parts.scheme, parts.hostname or "", parts.port), parts.path
        self._signer = Signer(credentials.get_frozen_credentials, region)
        self.user_agent = user_agent()
        self._pool = urllib3.PoolManager(
            num_pools=4, maxsize=8, retries=False, ca_certs=get_cert_path(True),
            timeout=urllib3.Timeout(connect=connect_timeout_s, read=read_timeout_s))
        self._errors = (urllib3.exceptions.HTTPError, OSError)

    def request(self, method: str, key: str, *, body: bytes | None = None, headers: dict[str, str] | None = None,
                max_read: int | None = None) -> tuple[int, bytes]:
        """(status, body) of one request, at most ``max_read`` bytes of the body read (a server
        that ignores a Range header cannot make a bounded read take a whole large object: the
        connection is dropped instead); connection failures and timeouts raised as
        TransientStoreError."""
        quoted = quote(key, safe="/~")
        url = self.base_url + quoted
        signed = self._signer.sign(method, self._host, self._base_path + quoted,
                                   {"User-Agent": self.user_agent, **(headers or {})}, body)
        try:
            response = self._pool.request(method, url, body=body, headers=signed, redirect=False,
                                          preload_content=False)
            try:
                data = response.read() if max_read is None else response.read(max_read)
                if max_read is not None and len(data) == max_read and response.read(1):
                    response.close()  # more than asked for: not read, the connection not reused
                    return response.status, data
            finally:
                response.release_conn()
        except self._errors as exc:
            raise TransientStoreError(f"{method} {key}: {type(exc).__name__}: {exc}") from exc
        return response.status, data

    def get(self, key: str, max_bytes: int | None) -> bytes:
        """The object (at most its first max_bytes + 1 bytes); FileNotFoundError when missing."""
        headers = {} if max_bytes is None else {"Range": f"bytes=0-{max_bytes}"}
        status, data = self.request("GET", key, headers=headers, max_read=None if max_bytes is None else max_bytes + 1)
        if status == 200 or (status == 206 and max_bytes is not None):
            return data
        if status == 404:
            raise FileNotFoundError(key)
        if status == 416 and max_bytes is not None:  # a range of an empty object
            return b""
        _transient_or_unexpected(status, "GET", key, data)

    def put(self, key: str, data: bytes, *, create: bool) -> bool:
        """Write the object; with ``create``, only if none is there: False when one is."""
        headers = {"Content-Length": str(len(data))}
        if create:
            headers["If-None-Match"] = "*"
        status, body = self.request("PUT", key, body=data, headers=headers)
        if status == 200:
            return True
        if create and status == 412:
            return False
        _transient_or_unexpected(status, "PUT", key, body)


def user_agent(environ: Mapping[str, str] = os.environ) -> str:
    """ddiloco's and botocore's versions, and ``app/NAME`` from ``AWS_SDK_UA_APP_ID`` as botocore
    adds it (bucket logs and the tests' request log tell processes apart by it)."""
    import botocore

    from ddiloco_cli import __version__

    app = environ.get("AWS_SDK_UA_APP_ID", "").strip()
    return f"ddiloco/{__version__} botocore/{botocore.__version__}" + (f" app/{app}" if app else "")


def _transient_or_unexpected(status: int, method: str, key: str, body: bytes) -> None:
    code = _error_code(body)
    # 409: a create-only PUT racing another on the same key (S3 asks for a retry)
    if status in (409, 429) or status >= 500:
        raise TransientStoreError(f"{method} {key}: HTTP {status} {code}".rstrip())
    raise Unexpected(f"{method} {key}: HTTP {status} {code}".rstrip())


def _error_code(body: bytes) -> str:
    """The <Code> of an S3 error document (for messages), or ''."""
    head = body[:2048]
    start = head.find(b"<Code>")
    end = head.find(b"</Code>", start)
    if start < 0 or end < 0:
        return ""
    return head[start + 6 : end].decode("ascii", "replace")[:64]


def from_s3fs(fs: Any, bucket: str, *, options: Mapping[str, Any], loop: Any, connect_timeout_s: float,
              read_timeout_s: float) -> FastS3:
    """The fast path for ``fs``'s bucket: its addressing and region from a URL that s3fs's client
    presigns (so custom endpoints, path or virtual-hosted style and the region are the client's),
    its credentials from botocore (the store's options, else the default chain)."""
    import botocore.session
    from botocore.credentials import Credentials
    from fsspec.asyn import sync

    client = fs.s3
    presigned = sync(loop, client.generate_presigned_url, "get_object",
                     Params={"Bucket": bucket, "Key": PROBE_KEY}, ExpiresIn=60)
    parts = urlsplit(presigned)
    if not parts.path.endswith("/" + PROBE_KEY):
        raise Unexpected(f"a presigned URL of an unexpected form: {parts.scheme}://{parts.netloc}{parts.path}")
    base_url = f"{parts.scheme}://{parts.netloc}{parts.path[: -len(PROBE_KEY)]}"
    region = client.meta.region_name
    if options.get("key") and options.get("secret"):
        credentials = Credentials(options["key"], options["secret"], options.get("token"))
    else:
        credentials = botocore.session.Session(profile=options.get("profile")).get_credentials()
        if credentials is None:
            raise Unexpected("no credentials found by botocore")
    return FastS3(base_url=base_url, region=region, credentials=credentials, connect_timeout_s=connect_timeout_s,
                  read_timeout_s=read_timeout_s)


__all__ = ["FastS3", "Unexpected", "wanted", "from_s3fs", "ENV_OFF"]
