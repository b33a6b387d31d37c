"""Every backend honours the contract in ddiloco_cli/store/base.py.

Runs against local, memory, S3 (moto server over HTTP) and GCS
(fake-gcs-server over HTTP): ``pytest tests/integration/test_store_conformance.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ddiloco_cli.errors import InvalidPayloadError, ProtocolError, StoreAccessError, UsageError
from ddiloco_cli.protocol import layout
from ddiloco_cli.store import (
    NotFound,
    ObjectInfo,
    ObjectTooLargeError,
    Store,
    UnreadableObjectError,
    open_store,
    parse_storage_options,
)
from ddiloco_cli.store.bounds import SMALL_RECORD_MAX_BYTES

# object mtimes come from the store's clock; S3 LastModified has whole seconds
CLOCK_SLACK_S = 5.0


def test_store_is_a_store(store):
    assert isinstance(store, Store)
    assert store.list() == []


def test_create_only_second_writer_loses(store):
    key = layout.manifest_key(0, 1)
    assert store.put_if_absent(key, b'{"writer": "a"}') is True
    assert store.put_if_absent(key, b'{"writer": "b"}') is False
    assert store.get(key) == b'{"writer": "a"}'


def test_create_only_same_bytes_retry_wins(store):
    # a retried create whose first attempt won (lost response) must report success
    key = layout.epoch_key(3)
    assert store.put_if_absent(key, b"nonce-123") is True
    assert store.put_if_absent(key, b"nonce-123") is True
    assert [o.key for o in store.list()] == [key]


def test_get_missing_raises_not_found(store):
    with pytest.raises(NotFound):
        store.get("no/such/key.json")
    with pytest.raises(KeyError):  # NotFound is a KeyError
        store.get("missing.json")


def test_put_overwrites(store):
    key = layout.learner_heartbeat_key("alice")
    store.put(key, b"one")
    store.put(key, b"two-longer")
    assert store.get(key) == b"two-longer"
    assert [(o.key, o.size) for o in store.list("learners/")] == [(key, len(b"two-longer"))]


def test_list_sorted_prefix_filtered_with_sizes(store):
    keys = [layout.manifest_key(1, v) for v in (10, 2, 0, 1)] + [
        layout.manifest_key(2, 0),
        layout.contribution_key(1, "bob", 7),
        "run.json",
    ]
    for i, key in enumerate(keys):
        assert store.put_if_absent(key, b"x" * (i + 1))
    infos = store.list()
    assert [o.key for o in infos] == sorted(keys)
    assert all(isinstance(o, ObjectInfo) for o in infos)
    sizes = {o.key: o.size for o in infos}
    assert sizes == {k: i + 1 for i, k in enumerate(keys)}

    manifests = store.list(layout.manifest_prefix(1))
    assert [o.key for o in manifests] == [layout.manifest_key(1, v) for v in (0, 1, 2, 10)]
    # a prefix that ends inside a name, not at a "/"
    partial = layout.manifest_prefix(1) + layout.num(1)[:-1]
    assert [o.key for o in store.list(partial)] == [layout.manifest_key(1, v) for v in (0, 1, 2)]
    assert [o.key for o in store.list("fragments/p0000")] == sorted(k for k in keys if k.startswith("fragments/"))
    assert store.list("nothing/here/") == []
    assert store.list("run") == [o for o in infos if o.key == "run.json"]


def test_list_skips_local_temp_files(store_url):
    store = open_store(store_url("local"))
    store.put_if_absent("a/b.json", b"1")
    root = store.root
    # a writer killed mid-write leaves its temp file behind
    with open(os.path.join(root, "a", ".tmp-deadbeef"), "wb") as f:
        f.write(b"partial")
    store.put("a/c.json", b"2")
    assert [o.key for o in store.list()] == ["a/b.json", "a/c.json"]
    assert sorted(os.listdir(os.path.join(root, "a"))) == [".tmp-deadbeef", "b.json", "c.json"]


def test_delete_is_idempotent(store):
    store.put_if_absent("x/y.bin", b"data")
    store.delete("x/y.bin")
    store.delete("x/y.bin")
    store.delete("never/was.bin")
    with pytest.raises(NotFound):
        store.get("x/y.bin")
    assert store.list() == []
    # the name is free again
    assert store.put_if_absent("x/y.bin", b"again") is True


def test_now_and_mtime_share_the_store_clock(store):
    before = store.now()
    store.put_if_absent("clock/obj.json", b"{}")
    after = store.now()
    (info,) = store.list("clock/")
    assert before - CLOCK_SLACK_S <= info.mtime_s <= after + CLOCK_SLACK_S
    assert after >= before - CLOCK_SLACK_S
    # clock probes leave nothing behind
    assert [o.key for o in store.list()] == ["clock/obj.json"]


def test_binary_round_trip(store):
    data = bytes(range(256)) * 64 + b"\x00\r\n\xff"
    assert store.put_if_absent("bin/all-bytes.safetensors", data)
    assert store.get("bin/all-bytes.safetensors") == data
    store.put("bin/empty", b"")
    assert store.get("bin/empty") == b""
    assert store.list("bin/empty")[0].size == 0


def test_nested_prefixes(store):
    deep = "a/b/c/d/e/f.json"
    store.put_if_absent(deep, b"1")
    store.put_if_absent("a/b/sibling.json", b"2")
    assert store.get(deep) == b"1"
    assert [o.key for o in store.list("a/b/c/")] == [deep]
    assert [o.key for o in store.list("a/")] == ["a/b/c/d/e/f.json", "a/b/sibling.json"]


def test_two_opens_share_data(store):
    other = open_store(store.url)
    store.put_if_absent("shared.json", json.dumps({"v": 1}).encode())
    assert json.loads(other.get("shared.json")) == {"v": 1}
    assert other.put_if_absent("shared.json", b"other") is False


def test_large_object_round_trip(store):
    # bigger than one socket buffer / upload chunk of the emulators' defaults
    data = os.urandom(3 * 2**20 + 17)
    assert store.put_if_absent("big/obj.bin", data)
    assert store.put_if_absent("big/obj.bin", os.urandom(100)) is False
    assert store.get("big/obj.bin") == data


@pytest.mark.gcs
def test_gcs_create_only_enforced_above_resumable_threshold(gcs_url):
    # gcsfs switches to a resumable upload at 50 MiB, where fake-gcs-server ignores
    # ifGenerationMatch; our create must stay on the enforced single-request path.
    store = open_store(gcs_url.url)
    size = 50 * 2**20 + 1
    first = b"a" * size
    assert store.put_if_absent("big.bin", first) is True
    assert store.put_if_absent("big.bin", b"b" * size) is False
    assert store.get("big.bin", max_bytes=size) == first  # above the default record bound


# -- open_store -------------------------------------------------------------


@pytest.mark.s3
def test_open_missing_s3_bucket_names_it(moto_server):
    with pytest.raises(StoreAccessError, match="no-such-bucket-4711"):
        open_store("s3://no-such-bucket-4711/run")


@pytest.mark.gcs
def test_open_missing_gcs_bucket_names_it(gcs_server):
    with pytest.raises(StoreAccessError, match="no-such-bucket-4711"):
        open_store("gs://no-such-bucket-4711/run")


@pytest.mark.s3
def test_open_s3_with_explicit_endpoint_option(moto_server, monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    store = open_store("s3://ddiloco-test/opt-run", options={"endpoint_url": moto_server})
    assert store.put_if_absent("k.json", b"1")
    assert store.get("k.json") == b"1"


@pytest.mark.parametrize("url", ["ftp://host/path", "hdfs://nn/run", "s3://", "gs:///prefix", "memory://", ""])
def test_open_bad_url_is_usage_error(url):
    with pytest.raises(UsageError):
        open_store(url)


def test_open_local_and_file_url(tmp_path):
    a = open_store(str(tmp_path / "run"))
    b = open_store(f"file://{tmp_path / 'run'}")
    a.put_if_absent("run.json", b"{}")
    assert b.get("run.json") == b"{}"
    with pytest.raises(UsageError):
        open_store(str(tmp_path), options={"anon": True})


def test_parse_storage_options():
    assert parse_storage_options(
        ["endpoint_url=http://127.0.0.1:5000", "anon=true", "use_ssl=False", "retries=3", "token=a=b", "x=none"]
    ) == {"endpoint_url": "http://127.0.0.1:5000", "anon": True, "use_ssl": False, "retries": 3, "token": "a=b", "x": None}
    assert parse_storage_options([]) == {}
    with pytest.raises(UsageError, match="KEY=VALUE"):
        parse_storage_options(["anon"])
    with pytest.raises(UsageError):
        parse_storage_options(["=1"])


def test_bad_keys_are_rejected(store):
    for key in ["", "/abs", "a//b", "../escape", "a/./b", "a/.tmp-x"]:
        with pytest.raises(AssertionError):
            store.put(key, b"1")


@pytest.mark.parametrize(
    "fixture", [pytest.param("s3_url", marks=pytest.mark.s3), pytest.param("gcs_url", marks=pytest.mark.gcs)]
)
def test_bucket_url_fixture_reaches_the_emulator_from_a_subprocess(fixture, request):
    # the contract other tests rely on: url + env are enough for a child process
    url, env = request.getfixturevalue(fixture)
    code = "import sys; from ddiloco_cli.store import open_store; open_store(sys.argv[1]).put_if_absent('from-child', b'hi')"
    subprocess.run([sys.executable, "-c", code, url], env=env, check=True, timeout=120)
    assert open_store(url).get("from-child") == b"hi"


# -- bounded reads ------------------------------------------------------------


def test_get_with_max_bytes_reads_up_to_the_bound(store):
    data = os.urandom(1000)
    store.put_if_absent("b/obj.bin", data)
    assert store.get("b/obj.bin", max_bytes=1000) == data
    assert store.get("b/obj.bin", max_bytes=10**9) == data
    with pytest.raises(ObjectTooLargeError) as info:
        store.get("b/obj.bin", max_bytes=999)
    err = info.value
    assert (err.key, err.max_bytes) == ("b/obj.bin", 999)
    assert err.size in (1000, None)  # the size when the backend can tell it cheaply
    assert "b/obj.bin" in str(err) and "999" in str(err)
    # bad bucket input: the readers' invalid-payload and invalid-record handlers catch it
    assert isinstance(err, InvalidPayloadError) and isinstance(err, ProtocolError)
    store.put("b/empty", b"")
    assert store.get("b/empty", max_bytes=0) == b""
    assert store.get("b/empty", max_bytes=10) == b""
    with pytest.raises(NotFound):
        store.get("b/missing.bin", max_bytes=10)


def test_create_only_against_a_larger_object_loses(store):
    # the lost-response check compares bytes; a larger existing object is not ours
    store.put_if_absent("b/k.bin", b"x" * 100)
    assert store.put_if_absent("b/k.bin", b"x" * 10) is False


def test_opened_stores_bound_every_read_by_key(store):
    big = b"{" + b" " * SMALL_RECORD_MAX_BYTES + b"}"
    key = layout.learner_heartbeat_key("mallory")
    store.put(key, big)
    with pytest.raises(ObjectTooLargeError, match="mallory"):
        store.get(key)
    store.put(key, b"{}")
    assert store.get(key) == b"{}"


@pytest.mark.timeout(60)
def test_local_refuses_a_fifo_without_blocking(store_url):
    store = open_store(store_url("local"))
    key = layout.contribution_key(0, "mallory", 1)
    path = os.path.join(store.root, *key.split("/"))
    os.makedirs(os.path.dirname(path))
    os.mkfifo(path)
    (info,) = store.list("contributions/")
    assert info.key == key
    with pytest.raises(UnreadableObjectError, match="not a regular file"):
        store.get(key)
    # a writer that finds it there loses the name, and does not block either
    assert store.put_if_absent(key, b"mine") is False


def test_local_refuses_a_symlink(store_url, tmp_path):
    store = open_store(store_url("local"))
    secret = tmp_path / "outside.txt"
    secret.write_bytes(b"secret")
    os.makedirs(os.path.join(store.root, "learners", "mallory"))
    os.symlink(secret, os.path.join(store.root, "learners", "mallory", "heartbeat.json"))
    with pytest.raises(UnreadableObjectError, match="symbolic link"):
        store.get(layout.learner_heartbeat_key("mallory"))
