"""Hostile objects at the epoch keys (issue 9; PROTOCOL.md [F4], [R2]), in a local bucket
and on S3 (the moto server): the claim loop neither stalls nor serves beside a newer
protocol. The other hostile inputs are in tests/unit/test_hostile_inputs.py."""

from __future__ import annotations

import pytest

from ddiloco_cli.errors import ProtocolError
from ddiloco_cli.protocol import layout, ledger, records
from ddiloco_cli.store import open_store

from support.hostile import DEEP, nested, one_error, run_cli
from support.runs import make_run

EPOCH_BACKENDS = ["local", pytest.param("s3", marks=pytest.mark.s3)]


def _junk_epochs(run_id: str) -> dict[str, bytes]:
    foreign = records.make("epoch", run_id="another-run", epoch=1, syncer_id="x", fragments=[0], nonce="n")
    wrong_number = records.make("epoch", run_id=run_id, epoch=99, syncer_id="x", fragments=[0], nonce="n")
    return {"garbage": b"\x00not json", "nested": nested(DEEP).encode(), "foreign run": records.dumps(foreign),
            "wrong number": records.dumps(wrong_number), "schema violation": b'{"format":"ddiloco.epoch"}'}


@pytest.mark.parametrize("backend", EPOCH_BACKENDS)
def test_junk_at_the_next_epoch_key_cannot_stall_the_claim_F4(store_url, backend):
    """[F4] invalid, foreign or mis-numbered objects at the next epoch key (real bytes in a
    local bucket and on S3): the claim goes above the highest listed key at once (it
    looped forever before), and the junk never fences or owns anything."""
    store = open_store(store_url(backend))
    run_id = make_run(store)["run_id"]
    for i, (name, body) in enumerate(_junk_epochs(run_id).items(), start=1):
        assert store.put_if_absent(layout.epoch_key(2 * i - 1), body), name
        got = ledger.claim_epoch(store, run_id=run_id, syncer_id=f"s{i}", fragments=[0], created_s=0.0)
        assert got is not None and got.epoch == 2 * i, name
    assert [e.epoch for e in ledger.list_epochs(store, run_id=run_id)] == [2, 4, 6, 8, 10]
    assert ledger.current_owner(store, run_id=run_id, fragments=[0]).syncer_id == "s5"


@pytest.mark.parametrize("backend", EPOCH_BACKENDS)
def test_newer_protocol_epoch_says_upgrade_F4_R2(store_url, backend, monkeypatch, capsys):
    """[F4][R2] a claim written by a newer protocol: `sync` exits with one "upgrade ddiloco"
    line instead of looping or serving next to a newer syncer."""
    store = open_store(store_url(backend))
    run_id = make_run(store)["run_id"]
    newer = {**records.make("epoch", run_id=run_id, epoch=1, syncer_id="new", fragments=[0, 1], nonce="n"),
             "protocol_version": records.PROTOCOL_VERSION + 1}
    assert store.put_if_absent(layout.epoch_key(1), records.dumps(newer))
    with pytest.raises(records.NewerProtocolError, match="upgrade ddiloco"):
        ledger.claim_epoch(store, run_id=run_id, syncer_id="old", fragments=[0], created_s=0.0)
    code, out = run_cli(monkeypatch, capsys, "sync", store.url, "--max-runtime", "5", "--no-gc")
    assert code == ProtocolError.exit_code and one_error(out, naming="upgradeddiloco"), out
    assert [i.key for i in store.list(layout.EPOCH_PREFIX)] == [layout.epoch_key(1)]
