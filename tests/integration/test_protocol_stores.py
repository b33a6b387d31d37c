"""The requirements of protocol/PROTOCOL.md that the store must meet ([S1]-[S6], and the
version race of [W3]), on a local directory, in memory and on S3 (the moto server).
The other MUSTs are in tests/unit/test_protocol.py."""

from __future__ import annotations

import re
import threading

import pytest

from ddiloco_cli.protocol import layout, ledger, records
from ddiloco_cli.store import open_store
from ddiloco_cli.store.base import NotFound

from support.runs import STORE_BACKENDS


@pytest.mark.parametrize("backend", STORE_BACKENDS)
def test_create_only_exactly_one_winner_S1(store_url, backend):
    """[S1] put_if_absent is atomic: of concurrent creators exactly one wins; the object holds its bytes."""
    store = open_store(store_url(backend))
    key = layout.manifest_key(0, 1)
    results: dict[int, bool] = {}
    barrier = threading.Barrier(4)

    def create(i: int) -> None:
        barrier.wait()
        results[i] = store.put_if_absent(key, f"writer {i}".encode())

    threads = [threading.Thread(target=create, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, ok in results.items() if ok]
    assert len(winners) == 1
    assert store.get(key) == f"writer {winners[0]}".encode()


@pytest.mark.parametrize("backend", STORE_BACKENDS)
def test_create_only_retry_settles_by_content_S2(store_url, backend):
    """[S2] a retried create of the same bytes reports success; different bytes report a conflict
    and leave the object unchanged."""
    store = open_store(store_url(backend))
    key = layout.contribution_key(0, "a", 7)
    assert store.put_if_absent(key, b"mine")
    assert store.put_if_absent(key, b"mine")  # our own lost-response retry
    assert not store.put_if_absent(key, b"theirs")
    assert store.get(key) == b"mine"


@pytest.mark.parametrize("backend", STORE_BACKENDS)
def test_list_is_lexicographic_numeric_and_fresh_S4_W4(store_url, backend):
    """[S4][W4] LIST returns every key under a prefix in lexicographic order, at once; 20-digit
    zero padding makes that numeric order. [S5] get of a missing key raises NotFound; delete is idempotent."""
    store = open_store(store_url(backend))
    for v in (10, 9, 100, 0):
        store.put_if_absent(layout.manifest_key(3, v), b"{}")
        assert layout.manifest_key(3, v) in [i.key for i in store.list(layout.manifest_prefix(3))]
    assert [layout.parse_num(i.key) for i in store.list(layout.manifest_prefix(3))] == [0, 9, 10, 100]
    assert all(re.fullmatch(r"fragments/p00003/manifests/\d{20}\.json", i.key) for i in store.list("fragments/"))
    with pytest.raises(NotFound):
        store.get(layout.manifest_key(3, 1))
    store.delete(layout.manifest_key(3, 0))
    store.delete(layout.manifest_key(3, 0))
    assert [layout.parse_num(i.key) for i in store.list(layout.manifest_prefix(3))] == [9, 10, 100]


@pytest.mark.parametrize("backend", STORE_BACKENDS)
def test_store_clock_matches_object_times_S6(store_url, backend):
    """[S6] now() and ObjectInfo.mtime_s are one clock (the store's): a fresh object is 0..5 s old."""
    store = open_store(store_url(backend))
    key = layout.syncer_heartbeat_key(1)
    store.put(key, b"x")
    (info,) = store.list(key)
    age = store.now() - info.mtime_s
    assert -1.0 <= age < 5.0  # S3 LastModified has whole seconds


@pytest.mark.parametrize("backend", STORE_BACKENDS)
def test_put_overwrites_non_authoritative_objects_S3(store_url, backend):
    """[S3] put replaces the whole object (heartbeats, hints)."""
    store = open_store(store_url(backend))
    key = layout.learner_heartbeat_key("a")
    store.put(key, b"one")
    store.put(key, b"two two")
    assert store.get(key) == b"two two"


@pytest.mark.parametrize("backend", STORE_BACKENDS)
def test_version_race_commits_exactly_once_W3(store_url, backend):
    """[W3] two writers committing the same version: exactly one create succeeds."""
    store = open_store(store_url(backend))
    base = dict(run_id="r", fragment=0, version=1, epoch=1, numel=1, contributions=[], high_water={},
                outer_steps=1,
                payloads=[{"key": layout.payload_key(0, 1, "full", "n"), "kind": "full", "size": 1, "sha256": "0" * 64}])
    results = []
    barrier = threading.Barrier(3)

    def commit(i: int) -> None:
        m = records.make("manifest", syncer_id=f"s{i}", nonce=records.new_nonce(), **base)
        barrier.wait()
        results.append((ledger.commit_manifest(store, m), m))

    threads = [threading.Thread(target=commit, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [m for ok, m in results if ok]
    assert len(won) == 1
    assert ledger.read_manifest(store, 0, 1) == won[0]
    assert ledger.list_versions(store, 0) == [1]
