"""Open a bucket by URL. The interface lives in ``store/base.py``.

URLs:

* a bare path or ``file:///abs/path``: a local directory (``LocalStore``);
* ``memory://name``: a process-global in-memory bucket, for unit tests
  (``MemoryStore``; two opens of the same name share data);
* ``s3://bucket/prefix``: S3 or any S3-compatible endpoint (``S3Store``);
* ``gs://bucket/prefix`` (or ``gcs://``): Google Cloud Storage (``GCSStore``).

Every store ``open_store`` returns is layered, outermost first:

* ``BoundedStore`` (``store/bounds.py``): every read is bounded by its key's size bound;
* ``RetryingStore`` (``store/retry.py``): the one retry policy of every call;
* ``FaultyStore`` (``store/faults.py``), only when faults are asked for;
* the backend.

Options (``-o key=value`` on the CLI, see ``parse_storage_options``) for every
backend: ``retry_attempts``, ``retry_base_delay_s``, ``retry_max_delay_s``,
``retry_deadline_s`` (the retry policy) and ``faults`` (fault injection; also
the ``DDILOCO_STORE_FAULTS`` environment variable). For the cloud backends:
``connect_timeout_s``, ``read_timeout_s``, ``endpoint_url``, ``anon``,
``key``/``secret``/``token``, ``region_name``, ``expect_100_continue`` and
``fast_requests`` (S3: ``store/s3fast.py``),
``project``/``token`` (GCS); an unknown option is refused (``BACKEND_OPTIONS``),
naming the closest known one. Environment variables are
honoured as usual: ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` and the AWS
credential chain for S3; ``STORAGE_EMULATOR_HOST`` (then ``token="anon"``) and
Google application-default credentials for GCS.
"""

from __future__ import annotations

import os

# gcsfs probes buckets for zonal/HNS support unless told not to, which hangs
# ~60 s per write against emulators; this must happen before gcsfs is imported.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

from ddiloco_cli.errors import UsageError
from ddiloco_cli.store.base import (
    NotFound,
    ObjectInfo,
    ObjectTooLargeError,
    Store,
    TransientStoreError,
    UnreadableObjectError,
)

__all__ = [
    "NotFound",
    "ObjectInfo",
    "ObjectTooLargeError",
    "Store",
    "TransientStoreError",
    "UnreadableObjectError",
    "check_key",
    "open_store",
    "parse_storage_options",
]

# Local temp files start with this; such names are never valid keys and never listed.
TEMP_PREFIX = ".tmp-"


def check_key(key: str) -> None:
    """Assert that ``key`` is a well-formed store key (relative, ``/``-separated, no
    empty, ``.`` or ``..`` segments, no temp-file names). Keys come from
    ``ddiloco_cli.protocol.layout``, so a bad one is a programming error."""
    parts = key.split("/")
    assert key and all(p not in ("", ".", "..") for p in parts), f"bad store key {key!r}"
    assert not parts[-1].startswith(TEMP_PREFIX), f"bad store key {key!r}"
    assert "\\" not in key and "\x00" not in key, f"bad store key {key!r}"


def _coerce(value: str) -> object:
    low = value.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null"):
        return None
    try:
        return int(value)
    except ValueError:
        pass
    try:
        return float(value)
    except ValueError:
        return value


def parse_storage_options(pairs: list[str]) -> dict:
    """Turn ``["endpoint_url=http://h:5000", "anon=true"]`` into a dict.

    Values ``true/false/yes/no/on/off`` become bools, ``none``/``null`` None,
    integers and floats numbers; anything else stays a string (split on the
    first ``=`` only, so values may contain ``=``). Raises ``UsageError`` for a
    pair without ``=`` or with an empty key.
    """
    out: dict = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(
                f"storage option {pair!r} is not KEY=VALUE; write e.g. -o endpoint_url=http://127.0.0.1:5000"
            )
        out[key] = _coerce(value)
    return out


# the options each cloud backend understands (after the retry_* and faults options are
# taken); anything else is refused, so a typo never silently falls back to a default
_COMMON_OPTIONS = ("connect_timeout_s", "read_timeout_s", "endpoint_url", "anon", "token", "requester_pays")
BACKEND_OPTIONS = {
    "s3": (*_COMMON_OPTIONS, "key", "secret", "region_name", "region", "expect_100_continue", "profile",
           "use_ssl", "config_kwargs", "client_kwargs", "s3_additional_kwargs", "fast_requests"),
    "gs": (*_COMMON_OPTIONS, "project", "access", "consistency"),
}


def check_backend_options(scheme: str, options: dict) -> None:
    """Raise ``UsageError`` for an option the ``scheme`` backend does not know, naming
    the closest known one (``-o endpoint=...`` -> "did you mean endpoint_url")."""
    import difflib

    from ddiloco_cli.store.retry import RetryPolicy

    known = BACKEND_OPTIONS[scheme]
    for name in options:
        if name in known:
            continue
        everything = (*known, *RetryPolicy.OPTIONS, "faults")
        close = difflib.get_close_matches(name, everything, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]}? " if close else ""
        raise UsageError(f"unknown storage option {name!r} for {scheme}://; {hint}"
                         f"known: {', '.join(sorted(everything))}")


def open_store(url: str, *, options: dict | None = None) -> Store:
    """Open the bucket at ``url`` (see the module docstring for the URL forms and
    the layers around the backend).

    Cloud backends check on open, with one cheap LIST, that the bucket exists
    and is readable, so a wrong URL or missing credentials fail at once.

    Raises ``UsageError`` for an unknown scheme, a URL without a bucket, or
    backend options given to a local/memory store; ``StoreAccessError`` when the
    bucket cannot be used (missing, access denied, endpoint unreachable).
    """
    from ddiloco_cli.store.bounds import BoundedStore
    from ddiloco_cli.store.faults import FAULTS_ENV, FaultSpec, FaultyStore
    from ddiloco_cli.store.retry import RetryingStore, RetryPolicy

    given = dict(options or {})
    options = dict(given)
    policy = RetryPolicy.pop_options(options)
    faults = options.pop("faults", None) or os.environ.get(FAULTS_ENV)
    store = _open_backend(url, options=options, policy=policy)
    if faults:
        store = FaultyStore(store, spec=FaultSpec.parse(str(faults)))
    opened = BoundedStore(RetryingStore(store, policy=policy))
    opened.open_args = (url, given)  # another process of ours opens the same bucket the same way (ioproc)
    return opened


def _open_backend(url: str, *, options: dict, policy) -> Store:
    if not url or not url.strip():
        raise UsageError("empty store URL; pass a directory, file://, s3://bucket/prefix or gs://bucket/prefix")
    url = url.strip()
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "file", url
    scheme = scheme.lower()

    if scheme in ("file", "memory") and options:
        raise UsageError(f"storage options {sorted(options)} only apply to s3:// and gs:// URLs, not {url!r}")
    if scheme == "file":
        from ddiloco_cli.store.local import LocalStore

        if sep and rest and not rest.startswith("/"):
            raise UsageError(f"{url!r}: a file URL needs an absolute path, like file:///data/run1")
        return LocalStore(rest or ".")
    if scheme == "memory":
        from ddiloco_cli.store.memory import MemoryStore

        if not rest.strip("/"):
            raise UsageError(f"{url!r}: give the in-memory bucket a name, like memory://test")
        return MemoryStore(rest.strip("/"))
    if scheme in ("s3", "gs", "gcs"):
        check_backend_options("s3" if scheme == "s3" else "gs", options)
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise UsageError(f"{url!r} names no bucket; write {scheme}://BUCKET/PREFIX")
        prefix = prefix.strip("/")
        if scheme == "s3":
            from ddiloco_cli.store.s3_store import S3Store

            return S3Store(bucket, prefix, options=options, policy=policy)
        from ddiloco_cli.store.fsspec_store import GCSStore

        return GCSStore(bucket, prefix, options=options, policy=policy)
    raise UsageError(
        f"unknown store URL scheme {scheme!r} in {url!r}; use a directory, file://, memory://, s3:// or gs://"
    )
