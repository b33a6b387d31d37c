"""The lean S3 path's own SigV4 signer against botocore's S3SigV4Auth: the same request at the
same moment signs to the same Authorization header, whatever the key, headers, body, token,
region or host."""

from __future__ import annotations

import calendar
import time
from urllib.parse import quote, urlsplit

import pytest

botocore = pytest.importorskip("botocore")
from botocore.auth import S3SigV4Auth  # noqa: E402
from botocore.awsrequest import AWSRequest  # noqa: E402
from botocore.credentials import Credentials  # noqa: E402

from ddiloco_cli.store.sigv4 import EMPTY_SHA256, Signer, host_header  # noqa: E402

STAMP = "20261207T081512Z"
NOW = calendar.timegm(time.strptime(STAMP, "%Y%m%dT%H%M%SZ"))


def botocore_headers(creds: Credentials, region: str, method: str, url: str, headers: dict[str, str],
                     body: bytes | None) -> dict[str, str]:
    """botocore's S3 signer on the same request at STAMP (its pieces, with the timestamp given
    rather than read from the clock)."""
    request = AWSRequest(method=method, url=url, data=body, headers=dict(headers))
    auth = S3SigV4Auth(creds.get_frozen_credentials(), "s3", region)
    request.context["timestamp"] = STAMP
    auth._modify_request_before_signing(request)
    canonical = auth.canonical_request(request)
    signature = auth.signature(auth.string_to_sign(request, canonical), request)
    auth._inject_signature_to_request(request, signature)
    return dict(request.headers.items())


CASES = [
    ("GET", "http://127.0.0.1:5000/bucket/", "run/fragments/p00003/manifests/00000000000000000012.json", {}, None),
    ("GET", "https://bucket.s3.eu-west-1.amazonaws.com/", "a b/+c=d&e/ü~x.json", {"Range": "bytes=0-65536"}, None),
    ("PUT", "https://s3.us-east-1.amazonaws.com/bucket/", "contrib/p1/l-0/000001.safetensors",
     {"Content-Length": "21", "If-None-Match": "*"}, b"x" * 21),
    ("PUT", "http://localhost:9000/b/", "k", {"Content-Length": "0"}, b""),
    ("GET", "https://minio.example.org:8443/b/", "deep/key", {"User-Agent": "ddiloco/0 app/x",
                                                             "X-Custom": "  spaced   value "}, None),
]


@pytest.mark.parametrize("token", [None, "session/token+with=chars"])
@pytest.mark.parametrize("region", ["us-east-1", "eu-west-1"])
@pytest.mark.parametrize("method,base,key,headers,body", CASES)
def test_signature_equals_botocores(method, base, key, headers, body, region, token):
    creds = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    url = base + quote(key, safe="/~")
    parts = urlsplit(url)
    signer = Signer(creds.get_frozen_credentials, region)  # botocore's frozen credentials, as s3fast passes them
    ours = signer.sign(method, host_header(parts.scheme, parts.hostname, parts.port), parts.path, headers, body,
                       now=NOW)
    theirs = botocore_headers(creds, region, method, url, headers, body)
    assert ours["Authorization"] == theirs["Authorization"]
    assert ours["X-Amz-Date"] == theirs["X-Amz-Date"] == STAMP
    assert ours["X-Amz-Content-SHA256"] == theirs["X-Amz-Content-SHA256"]
    assert ours.get("X-Amz-Security-Token") == theirs.get("X-Amz-Security-Token") == token


def test_known_answer():
    """A fixed request's signature, so a change in both signers at once cannot pass unseen."""
    signer = Signer(Credentials("AKIDEXAMPLE", "secret").get_frozen_credentials, "us-east-1")
    h = signer.sign("GET", "127.0.0.1:5000", "/bucket/k", {}, None, now=NOW)
    assert h["X-Amz-Content-SHA256"] == EMPTY_SHA256
    assert h["Authorization"].startswith("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20261207/us-east-1/s3/aws4_request, "
                                         "SignedHeaders=host;x-amz-content-sha256;x-amz-date, Signature=")
    creds = Credentials("AKIDEXAMPLE", "secret")
    assert h["Authorization"] == botocore_headers(creds, "us-east-1", "GET", "http://127.0.0.1:5000/bucket/k", {},
                                                  None)["Authorization"]


def test_signing_key_is_derived_once_a_day_and_secret():
    secrets = iter(["s1", "s1", "s2"])
    signer = Signer(lambda: Credentials("AK", next(secrets)).get_frozen_credentials(), "us-east-1")
    signer.sign("GET", "h", "/b/k", {}, now=NOW)
    key1 = signer._key
    signer.sign("GET", "h", "/b/k", {}, now=NOW + 60)
    assert signer._key is key1  # the same secret and day: kept
    signer.sign("GET", "h", "/b/k", {}, now=NOW + 120)
    assert signer._key is not key1 and signer._key[0] == ("s2", "20261207")  # a rotated secret: derived again
    signer2 = Signer(Credentials("AK", "s1").get_frozen_credentials, "us-east-1")
    signer2.sign("GET", "h", "/b/k", {}, now=NOW + 86400)
    assert signer2._key[0] == ("s1", "20261208") and signer2._key[1] != key1[1]  # the next day: a new key


def test_host_header():
    assert host_header("https", "Bucket.S3.amazonaws.com", 443) == "bucket.s3.amazonaws.com"
    assert host_header("http", "localhost", 80) == "localhost"
    assert host_header("http", "localhost", 5000) == "localhost:5000"
    assert host_header("https", "::1", 9000) == "[::1]:9000"
    assert host_header("https", "h", None) == "h"
