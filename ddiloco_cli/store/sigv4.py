"""AWS Signature Version 4 for the S3 store's lean request path (store/s3fast.py).

botocore's ``S3SigV4Auth`` builds a request object, walks its headers through a case-insensitive
map, derives the signing key with four HMACs and formats the date through ``datetime`` on every
request: about a sixth of the lean path's client CPU on a learner (0.49-0.58 ms a request with it,
0.43-0.48 without, docs/results.md). Here the signing key is derived once a (secret, day) and
kept, and a request's canonical form is a few string joins: the same signature botocore computes
for the same request (tests/unit/test_sigv4.py holds them equal, header for header), 7x faster
for a GET (3.5x for a 21 kB PUT, whose body both hash; ``scripts/bench_s3_client.py``).

Only what the lean path sends is covered: one object's URL with no query string, a body given
whole (its SHA-256 signed, as botocore signs it over http and over https without a checksum
header), and the headers passed in, every one of them signed (the host, the ``x-amz-*`` ones and
any other; a ``User-Agent`` is sent unsigned, as botocore leaves it out).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Any, Callable

ALGORITHM = "AWS4-HMAC-SHA256"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
UNSIGNED = frozenset(("user-agent", "expect", "connection", "keep-alive", "transfer-encoding"))


def host_header(scheme: str, hostname: str, port: int | None) -> str:
    """The Host value a request is signed with: lowercase, the port only when not the scheme's
    default (as botocore and urllib3 write it)."""
    host = hostname.lower()
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    if port is not None and port != {"http": 80, "https": 443}.get(scheme):
        host = f"{host}:{port}"
    return host


class Signer:
    """Signs requests to one service in one region with credentials read per request
    (``credentials()``: botocore's ``get_frozen_credentials``, anything with ``access_key``,
    ``secret_key`` and ``token``; refreshed ones are picked up as they change)."""

    def __init__(self, credentials: Callable[[], Any], region: str, service: str = "s3"):
        self.credentials, self.region, self.service = credentials, region, service
        self._key: tuple[tuple[str, str], bytes] | None = None  # ((secret, day), signing key)

    def signing_key(self, secret: str, day: str) -> bytes:
        """HMAC chain of the secret over day, region, service and ``aws4_request`` (kept while the
        secret and the day are the same)."""
        cached = self._key
        if cached is not None and cached[0] == (secret, day):
            return cached[1]
        key = ("AWS4" + secret).encode()
        for part in (day, self.region, self.service, "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        self._key = ((secret, day), key)
        return key

    def sign(self, method: str, host: str, path: str, headers: dict[str, str], body: bytes | None = None,
             *, now: float | None = None) -> dict[str, str]:
        """The headers to send: ``headers`` plus Host, X-Amz-Date, X-Amz-Content-SHA256,
        X-Amz-Security-Token (with a session token) and Authorization. ``path``: the URL's path
        exactly as sent (already percent-encoded; S3 signs it as it is). ``now``: the signing
        time (default: this host's clock)."""
        cred = self.credentials()
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
        day = stamp[:8]
        payload = hashlib.sha256(body).hexdigest() if body else EMPTY_SHA256
        out = {"Host": host, **headers, "X-Amz-Date": stamp, "X-Amz-Content-SHA256": payload}
        if cred.token:
            out["X-Amz-Security-Token"] = cred.token
        signed: dict[str, str] = {}
        for name, value in out.items():
            lname = name.lower()
            if lname not in UNSIGNED:
                value = " ".join(str(value).split())
                signed[lname] = f"{signed[lname]},{value}" if lname in signed else value
        names = sorted(signed)
        signed_names = ";".join(names)
        canonical = "\n".join((method.upper(), path or "/", "", "".join(f"{n}:{signed[n]}\n" for n in names),
                               signed_names, payload))
        scope = f"{day}/{self.region}/{self.service}/aws4_request"
        to_sign = f"{ALGORITHM}\n{stamp}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        signature = hmac.new(self.signing_key(cred.secret_key, day), to_sign.encode(), hashlib.sha256).hexdigest()
        out["Authorization"] = (f"{ALGORITHM} Credential={cred.access_key}/{scope}, SignedHeaders={signed_names}, "
                                f"Signature={signature}")
        return out


__all__ = ["Signer", "host_header", "EMPTY_SHA256"]
