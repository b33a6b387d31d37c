"""The S3 store's lean request path (ddiloco_cli/store/s3fast.py): what it sends and how it reads
each answer, against a real HTTP server that answers as scripted; and, against the moto server,
that the store falls back to s3fs on an answer the path does not expect and loses nothing. The
store's whole contract on S3 (with the path on) is tests/integration/test_store_conformance.py's."""

from __future__ import annotations

import http.server
import logging
import socket
import threading

import pytest

from botocore.credentials import Credentials

from ddiloco_cli.store import open_store, s3fast
from ddiloco_cli.store.base import NotFound, TransientStoreError


class Scripted(http.server.BaseHTTPRequestHandler):
    """Answers each request with the next (status, body) of the server's script and records
    (method, path, headers, body)."""

    protocol_version = "HTTP/1.1"

    def _answer(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        self.server.seen.append((self.command, self.path, dict(self.headers), body))
        status, out = self.server.script.pop(0)
        self.send_response(status)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_PUT = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    srv.script, srv.seen = [], []
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _fast(srv, region="us-west-2", credentials=None) -> s3fast.FastS3:
    return s3fast.FastS3(base_url=f"http://127.0.0.1:{srv.server_address[1]}/bucket/", region=region,
                         credentials=credentials or Credentials("AKIDEXAMPLE", "secret"), connect_timeout_s=5,
                         read_timeout_s=5)


def server_signature(seen, credentials: Credentials, region: str) -> tuple[str, str]:
    """(the signature a request carried, the one a server computes from what arrived) as S3 and
    moto check it: botocore's S3 signer over the method, the path as sent, the headers the request
    says it signed and the body."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest

    method, path, headers, body = seen
    auth = headers["Authorization"]
    signed = auth.partition("SignedHeaders=")[2].partition(",")[0].split(";")
    request = AWSRequest(method=method, url=path, data=body,
                         headers={k: v for k, v in headers.items() if k.lower() in signed})
    request.context["timestamp"] = headers["X-Amz-Date"]
    signer = S3SigV4Auth(credentials.get_frozen_credentials(), "s3", region)
    string_to_sign = signer.string_to_sign(request, signer.canonical_request(request))
    return auth.partition("Signature=")[2], signer.signature(string_to_sign, request)


@pytest.mark.parametrize("token", [None, "session-token/+="])
def test_what_arrives_verifies_as_signed(server, token):
    """Each request as the server received it (the Host urllib3 wrote, the path as sent, the body)
    carries the signature a SigV4 server computes: keys with spaces, non-ASCII and reserved
    characters, ranged GETs, create-only and plain PUTs, a session token."""
    creds = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    fast = _fast(server, region="eu-central-1", credentials=creds)
    server.script += [(200, b"x")] * 5
    fast.get("run/a b/ü+=&~x.json", None)
    fast.get("run/m/00000000000000000001.json", 1 << 16)
    fast.put("run/contributions/p00001/l-0/000001.safetensors", b"\x00payload" * 100, create=True)
    fast.put("run/heartbeats/l-0.json", b"{}", create=False)
    fast.put("run/empty", b"", create=False)
    assert len(server.seen) == 5
    for seen in server.seen:
        carried, computed = server_signature(seen, creds, "eu-central-1")
        assert carried == computed, seen[:2]
        assert seen[2].get("X-Amz-Security-Token") == token


def test_a_get_is_signed_ranged_when_bounded_and_its_answers_read(server, monkeypatch):
    monkeypatch.setenv("AWS_SDK_UA_APP_ID", "learner-7")
    fast = _fast(server)
    error = b"<?xml version='1.0'?><Error><Code>PermanentRedirect</Code></Error>"
    server.script += [(200, b"whole"), (206, b"part"), (404, b""), (416, b""), (503, b"<Error><Code>SlowDown</Code>"),
                      (301, error)]
    assert fast.get("run/a b/x.json", None) == b"whole"
    assert fast.get("run/x", 9) == b"part"
    with pytest.raises(FileNotFoundError):
        fast.get("run/missing", None)
    assert fast.get("run/empty", 9) == b""  # a range of an empty object
    with pytest.raises(TransientStoreError, match="503 SlowDown"):
        fast.get("run/x", None)
    with pytest.raises(s3fast.Unexpected, match="301 PermanentRedirect"):
        fast.get("run/x", None)
    (m0, path0, h0, _), (_, _, h1, _) = server.seen[:2]
    assert m0 == "GET" and path0 == "/bucket/run/a%20b/x.json"
    assert "Range" not in h0 and h1["Range"] == "bytes=0-9"
    auth = h0["Authorization"]
    assert auth.startswith("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/") and "/us-west-2/s3/aws4_request" in auth
    assert "x-amz-content-sha256" in {k.lower() for k in h0}
    assert h0["User-Agent"].startswith("ddiloco/") and h0["User-Agent"].endswith(" app/learner-7")


def test_a_bounded_read_stops_at_its_bound_when_the_server_ignores_the_range(server):
    fast = _fast(server)
    server.script += [(200, b"x" * 100_000), (200, b"small")]
    assert fast.get("run/big", 9) == b"x" * 10  # max_bytes + 1: the caller then refuses it as too large
    assert fast.get("run/small", 9) == b"small"  # a fresh connection serves the next request


def test_a_create_sends_if_none_match_and_reads_a_conflict(server):
    fast = _fast(server)
    server.script += [(200, b""), (412, b""), (409, b"<Error><Code>ConditionalRequestConflict</Code>"),
                      (200, b""), (400, b"<Error><Code>InvalidArgument</Code>")]
    assert fast.put("run/c", b"data", create=True) is True
    assert fast.put("run/c", b"data", create=True) is False
    with pytest.raises(TransientStoreError, match="409"):  # a create racing another: S3 asks for a retry
        fast.put("run/c", b"data", create=True)
    assert fast.put("run/h", b"beat", create=False) is True
    with pytest.raises(s3fast.Unexpected, match="400 InvalidArgument"):
        fast.put("run/h", b"beat", create=False)
    methods = [(m, p, h.get("If-None-Match"), b) for m, p, h, b in server.seen]
    assert methods[0] == ("PUT", "/bucket/run/c", "*", b"data")
    assert methods[3] == ("PUT", "/bucket/run/h", None, b"beat")


def test_an_endpoint_that_is_not_there_is_a_transient_failure():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fast = s3fast.FastS3(base_url=f"http://127.0.0.1:{port}/b/", region="us-east-1",
                         credentials=Credentials("a", "b"), connect_timeout_s=2, read_timeout_s=2)
    with pytest.raises(TransientStoreError):
        fast.get("k", None)


def test_the_path_is_only_taken_where_s3fs_would_do_nothing_else():
    assert s3fast.wanted({}, {}) == (True, "")
    assert s3fast.wanted({"key": "a", "secret": "b", "token": "c", "profile": "p"}, {}) == (True, "")
    ok, why = s3fast.wanted({"s3_additional_kwargs": {"ServerSideEncryption": "aws:kms"}}, {})
    assert not ok and "s3_additional_kwargs" in why
    ok, why = s3fast.wanted({"requester_pays": True}, {})
    assert not ok and "requester_pays" in why
    ok, why = s3fast.wanted({}, {"HTTPS_PROXY": "http://proxy:3128"})
    assert not ok and "HTTPS_PROXY" in why
    ok, why = s3fast.wanted({}, {s3fast.ENV_OFF: "0"})
    assert not ok and s3fast.ENV_OFF in why


def _backend(store):
    while hasattr(store, "inner"):
        store = store.inner
    return store


@pytest.mark.s3
def test_an_unexpected_answer_turns_the_path_off_and_s3fs_serves_the_call(store_url, server, caplog):
    store = open_store(store_url("s3"))
    backend = _backend(store)
    assert backend._fast is not None  # on by default against moto
    store.put("m/0.json", b"manifest")
    assert store.put_if_absent("c/1", b"one")
    real = backend._fast
    backend._fast = _fast(server)  # answers from elsewhere: a redirect to another region
    server.script.append((301, b"<Error><Code>PermanentRedirect</Code></Error>"))
    with caplog.at_level(logging.WARNING, logger="ddiloco_cli.store.s3_store"):
        assert store.get("m/0.json") == b"manifest"  # through s3fs
    assert backend._fast is None and "through s3fs from now on" in caplog.text
    assert not store.put_if_absent("c/1", b"two") and store.put_if_absent("c/1", b"one")
    with pytest.raises(NotFound):
        store.get("m/missing")
    assert real.get(backend._object_key(backend._path("m/0.json")), None) == b"manifest"  # the path itself was fine


@pytest.mark.s3
def test_the_path_can_be_turned_off_and_s3fs_alone_keeps_the_contract(store_url):
    url = store_url("s3")
    store = open_store(url, options={"fast_requests": False})
    assert _backend(store)._fast is None
    assert store.put_if_absent("c/1", b"one") and not store.put_if_absent("c/1", b"two")
    assert store.put_if_absent("c/1", b"one")  # our own lost-response retry
    store.put("h", b"x" * 100)
    assert store.get("h", max_bytes=100) == b"x" * 100
    with pytest.raises(NotFound):
        store.get("missing")
    fast = open_store(url)  # the same objects through the path
    assert _backend(fast)._fast is not None and fast.get("c/1") == b"one" and fast.get("h") == b"x" * 100


@pytest.mark.s3
def test_a_region_option_keeps_the_path_and_other_s3fs_options_turn_it_off(store_url):
    assert _backend(open_store(store_url("s3"), options={"region_name": "us-east-1"}))._fast is not None
    off = open_store(store_url("s3"), options={"s3_additional_kwargs": {"StorageClass": "STANDARD"}})
    assert _backend(off)._fast is None
    assert off.put_if_absent("k", b"v") and off.get("k") == b"v"
