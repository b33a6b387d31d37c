"""Signed contributions, records and admissions (PROTOCOL.md, "Signatures"; ids [A1]-[A6]).

Library round trips first (sign -> verify, and every way a signature must fail:
unsigned, forged, another run, another key, an unadmitted or replayed key), then
the `keys new`, `init --require-signatures` and `admit` commands through CliRunner.
"""

from __future__ import annotations

import json
import os
import stat
import uuid

import pytest
import safetensors.torch
import torch
from typer.testing import CliRunner

from ddiloco_cli.cli.app import app
from ddiloco_cli.errors import InvalidPayloadError, UsageError
from ddiloco_cli.numerics import codec
from ddiloco_cli.protocol import layout, ledger, records, signing
from ddiloco_cli.protocol.signing import SignatureError
from ddiloco_cli.store import open_store

RUN = "ed60776216ed4c78b7f75565aa1fe720"
KEY = layout.contribution_key(0, "a", 7)


@pytest.fixture
def keys(tmp_path):
    return {name: signing.new_key(tmp_path / f"{name}.pem") for name in ("admin", "a", "b", "syncer")}


def _payload(seq: int = 7, value: float = 0.5) -> bytes:
    header = records.make("contribution", run_id=RUN, fragment=0, learner_id="a", seq=seq, base_version=0,
                          c_tokens=64, c_steps=1, nonce=records.new_nonce())
    return codec.encode_tensors({"w": torch.full((4, 3), value), "b": torch.arange(5.0)}, codec="int8", metadata=header)


def _signed(keys, **kw) -> bytes:
    return signing.sign_payload(_payload(**kw), kind="contribution", run_id=RUN, key=KEY, signer=keys["a"])


# ------------------------------------------------------------------------ keys
def test_new_key_is_private_pem_and_loads_back(keys, tmp_path):
    path = tmp_path / "a.pem"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert (tmp_path / "a.pem.pub").read_text().strip() == keys["a"].public_key
    assert signing.load_key(path).public_key == keys["a"].public_key
    with pytest.raises(UsageError, match="already exists"):
        signing.new_key(path)
    assert signing.load_key(path).public_key == keys["a"].public_key  # not overwritten


def test_bad_key_files_give_clear_errors(tmp_path):
    with pytest.raises(UsageError, match="no such file.*ddiloco keys new"):
        signing.load_key(tmp_path / "missing.pem")
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(b"not a key")
    garbage.chmod(0o600)
    with pytest.raises(UsageError, match="not an unencrypted PEM private key"):
        signing.load_key(garbage)
    shared = signing.new_key(tmp_path / "shared.pem").path
    shared.chmod(0o644)
    with pytest.raises(UsageError, match="other users can read.*chmod 600"):
        signing.load_key(shared)
    if os.geteuid() != 0:  # root reads any file
        locked = signing.new_key(tmp_path / "locked.pem").path
        locked.chmod(0o000)
        with pytest.raises(UsageError, match="cannot read"):
            signing.load_key(locked)
    with pytest.raises(UsageError, match="64 hex digits"):
        signing.parse_public_key("abc")
    # issue 26 item 6: a .pub file is named as such before any chmod advice; the admin key is not `keys new`'s
    pub = tmp_path / "shared.pem.pub"
    pub.chmod(0o644)
    with pytest.raises(UsageError, match=r"this is a public key; pass the private key file \(.*shared.pem\)$"):
        signing.load_key(pub)
    with pytest.raises(UsageError, match="the one `ddiloco init` made") as exc:
        signing.load_admin_key(tmp_path / "missing-admin.pem", create=False)
    assert "keys new" not in str(exc.value)


def test_syncer_without_a_key_is_told_the_admit_command_with_a_name(keys):
    store = open_store(f"memory://{uuid.uuid4().hex}")
    run = {"run_id": RUN, "require_signatures": True, "admin_key": keys["admin"].public_key}
    with pytest.raises(UsageError, match="--role syncer") as exc:
        signing.signer_for_run(store, run=run, key_path=None, member_id=None, role="syncer")
    assert "None" not in str(exc.value) and "admit memory://" in str(exc.value) and " NAME PUBKEY" in str(exc.value)


def test_default_requirement_follows_the_url():
    assert signing.default_require_signatures("s3://bucket/run")
    assert signing.default_require_signatures("gs://bucket/run")
    assert not signing.default_require_signatures("/data/run")
    assert not signing.default_require_signatures("file:///data/run")


# ------------------------------------------------------------------- payloads
def test_signed_payload_verifies_and_still_decodes_A2(keys):
    data = _signed(keys)
    assert signing.verify_payload(data, kind="contribution", run_id=RUN, key=KEY,
                                  allowed={keys["a"].public_key}) == keys["a"].public_key
    tensors, meta = codec.decode_tensors(data, expected={"w": (4, 3), "b": (5,)})
    plain, plain_meta = codec.decode_tensors(_payload(), expected={"w": (4, 3), "b": (5,)})
    assert all(torch.equal(tensors[k], plain[k]) for k in plain) and meta["seq"] == plain_meta["seq"]
    assert set(safetensors.torch.load(data)) == {"w", "b"}  # still a standard safetensors file


def test_unsigned_forged_and_misplaced_payloads_fail_A2(keys):
    allowed = {keys["a"].public_key}

    def verify(data: bytes, *, kind="contribution", run_id=RUN, key=KEY, allowed=allowed) -> None:
        signing.verify_payload(data, kind=kind, run_id=run_id, key=key, allowed=allowed)

    with pytest.raises(SignatureError, match="unsigned"):
        verify(_payload())
    data = _signed(keys)
    with pytest.raises(SignatureError, match="forged"):  # moved to another seq / learner / fragment
        verify(data, key=layout.contribution_key(0, "a", 8))
    with pytest.raises(SignatureError, match="forged"):  # copied into another run
        verify(data, run_id=uuid.uuid4().hex)
    with pytest.raises(SignatureError, match="forged"):  # another object type
        verify(data, kind="checkpoint")
    with pytest.raises(SignatureError, match="not the key admitted"):  # signed by b, checked as a's
        verify(signing.sign_payload(_payload(), kind="contribution", run_id=RUN, key=KEY, signer=keys["b"]))
    with pytest.raises(SignatureError, match="not admitted to this run"):
        verify(data, allowed=())
    # a's signature transplanted onto other tensors (same header layout, other values)
    other = _payload(value=-3.0)
    sig = json.loads(codec._parse_safetensors(data, "x")[0]["__metadata__"][signing.PAYLOAD_FIELD])
    header, start = codec._parse_safetensors(other, "x")
    header["__metadata__"][signing.PAYLOAD_FIELD] = json.dumps(sig)
    hbytes = json.dumps(header).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    with pytest.raises(SignatureError, match="forged"):
        verify(len(hbytes).to_bytes(8, "little") + hbytes + other[start:])
    with pytest.raises(InvalidPayloadError):  # not even a payload
        verify(b"\x00" * 20)


def test_every_single_byte_change_fails_or_means_the_same_A2(keys):
    """A flipped byte anywhere either breaks the signature (or the parse) or leaves
    what every reader decodes unchanged: the signature covers the meaning, not
    the JSON whitespace."""
    data = _signed(keys)
    expected = {"w": (4, 3), "b": (5,)}
    reference = codec.decode_tensors(data, expected=expected)
    accepted_changes = 0
    for i in range(len(data)):
        mutated = bytearray(data)
        mutated[i] ^= 0x01
        try:
            signing.verify_payload(bytes(mutated), kind="contribution", run_id=RUN, key=KEY,
                                   allowed={keys["a"].public_key})
        except (SignatureError, InvalidPayloadError):  # or an unparsable header
            continue
        tensors, meta = codec.decode_tensors(bytes(mutated), expected=expected)
        assert meta == reference[1] and all(torch.equal(tensors[k], reference[0][k]) for k in expected), i
        accepted_changes += 1
    assert accepted_changes < len(data) // 20  # only the header's padding spaces may change


# -------------------------------------------------------------------- records
def test_signed_record_round_trip_and_failures_A3(keys):
    key = layout.learner_heartbeat_key("a")
    beat = records.make("learner_heartbeat", run_id=RUN, learner_id="a", state="running", step=3, tokens=96)
    signed = signing.sign_record(beat, run_id=RUN, key=key, signer=keys["a"])
    parsed = records.loads(records.dumps(signed), "learner_heartbeat", where=key)  # survives the bucket round trip
    allowed = {keys["a"].public_key}
    assert signing.verify_record(parsed, run_id=RUN, key=key, allowed=allowed) == keys["a"].public_key
    with pytest.raises(SignatureError, match="unsigned"):
        signing.verify_record(beat, run_id=RUN, key=key, allowed=allowed)
    with pytest.raises(SignatureError, match="forged"):
        signing.verify_record({**parsed, "step": 4}, run_id=RUN, key=key, allowed=allowed)
    with pytest.raises(SignatureError, match="forged"):  # a's heartbeat replayed as b's
        signing.verify_record(parsed, run_id=RUN, key=layout.learner_heartbeat_key("b"), allowed=allowed)
    with pytest.raises(SignatureError, match="forged"):
        signing.verify_record(parsed, run_id=uuid.uuid4().hex, key=key, allowed=allowed)
    with pytest.raises(SignatureError, match="malformed"):
        signing.verify_record({**parsed, "signature": {"alg": "rsa", "key": "00", "sig": "00"}}, run_id=RUN, key=key,
                              allowed=allowed)


# ----------------------------------------------------------------- admissions
def _signed_run(store, admin: signing.Signer) -> dict:
    run = {"run_id": RUN, "require_signatures": True, "admin_key": admin.public_key}
    store.put(layout.RUN_CONFIG, json.dumps(run).encode())  # only read back by tests here
    return run


def test_admissions_are_checked_against_the_admin_key_A1(keys):
    store = open_store(f"memory://{uuid.uuid4().hex}")
    run = _signed_run(store, keys["admin"])
    signing.admit(store, run=run, member_id="a", public_key=keys["a"].public_key, role="learner", admin=keys["admin"])
    signing.admit(store, run=run, member_id="s", public_key=keys["syncer"].public_key, role="syncer",
                  admin=keys["admin"])
    with pytest.raises(UsageError, match="not the run's"):
        signing.admit(store, run=run, member_id="b", public_key=keys["b"].public_key, role="learner", admin=keys["b"])
    # b admits itself with its own key; a's admission is copied to c; one from another run is replayed here
    fake = records.make("admission", run_id=RUN, id="b", role="learner", public_key=keys["b"].public_key, nonce="n")
    store.put(layout.admission_key("b"), records.dumps(
        signing.sign_record(fake, run_id=RUN, key=layout.admission_key("b"), signer=keys["b"])))
    store.put(layout.admission_key("c"), store.get(layout.admission_key("a")))
    other = signing.admit(open_store(f"memory://{uuid.uuid4().hex}"), run={**run, "run_id": uuid.uuid4().hex},
                          member_id="d", public_key=keys["b"].public_key, role="learner", admin=keys["admin"])
    store.put(layout.admission_key("d"), records.dumps({**other, "run_id": RUN}))  # its run_id edited to ours
    store.put(layout.admission_key("e"), b'{"format": "ddiloco.admission", "id": [[[[[')

    ring = signing.KeyRing(store, run=run)
    ring.refresh()
    assert ring.keys_of("a", role="learner") == (keys["a"].public_key,)
    assert ring.keys_of("a", role="syncer") == ()
    assert ring.keys_with_role("syncer") == {keys["syncer"].public_key}
    assert not any(ring.keys_of(m, role="learner") for m in "bcde")
    assert set(ring.problems) == {layout.admission_key(m) for m in "bcde"}
    assert "not the key admitted" in ring.problems[layout.admission_key("b")]  # b's key is not the admin's
    assert "not this key and run" in ring.problems[layout.admission_key("c")]
    assert "forged" in ring.problems[layout.admission_key("d")]

    # rotation: re-admitting a replaces its key (a refresh naming a re-reads it even if size and mtime tie)
    signing.admit(store, run=run, member_id="a", public_key=keys["b"].public_key, role="learner", admin=keys["admin"])
    ring.refresh(member_id="a")
    assert ring.keys_of("a", role="learner") == (keys["b"].public_key,)
    store.delete(layout.admission_key("a"))  # revoked by deletion
    ring.refresh()
    assert ring.keys_of("a", role="learner") == ()


def test_trust_rereads_admissions_for_a_new_learner_A4(keys):
    store = open_store(f"memory://{uuid.uuid4().hex}")
    run = _signed_run(store, keys["admin"])
    trust = signing.Trust(store, run=run, refresh_s=0.0)
    data = _signed(keys)
    with pytest.raises(SignatureError, match="not admitted to this run"):
        trust.check_payload(data, kind="contribution", key=KEY, member_id="a")
    signing.admit(store, run=run, member_id="a", public_key=keys["a"].public_key, role="learner", admin=keys["admin"])
    trust.check_payload(data, kind="contribution", key=KEY, member_id="a")  # admitted later: picked up
    with pytest.raises(SignatureError):  # a's key is not a syncer key
        trust.check_record(records.make("epoch", run_id=RUN, epoch=1, syncer_id="x", fragments=[0], nonce="n"),
                           key=layout.epoch_key(1), role="syncer")
    # revocation: a's admission deleted; a trust that re-reads at every check refuses a at once
    store.delete(layout.admission_key("a"))
    with pytest.raises(SignatureError, match="not admitted"):
        signing.Trust(store, run=run, max_age_s=0.0).check_payload(data, kind="contribution", key=KEY, member_id="a")
    trust.max_age_s = 0.0
    with pytest.raises(SignatureError, match="not admitted"):
        trust.check_payload(data, kind="contribution", key=KEY, member_id="a")
    open_trust = signing.Trust(store, run={"run_id": RUN})
    open_trust.check_payload(_payload(), kind="contribution", key=KEY, member_id="nobody")  # not required: passes
    assert open_trust.ring is None


# ------------------------------------------------------------------------ CLI
def test_keys_init_admit_commands_A1(tmp_path):
    runner = CliRunner()
    key_path = tmp_path / "keys" / "a.pem"
    r = runner.invoke(app, ["keys", "new", str(key_path)])
    assert r.exit_code == 0, r.output
    pub = r.stdout.strip().splitlines()[-1]
    assert pub == (tmp_path / "keys" / "a.pem.pub").read_text().strip()
    url = str(tmp_path / "run")
    admin = tmp_path / "admin.pem"
    r = runner.invoke(app, ["init", url, "--task", "ddiloco_cli.tasks.gpt:tiny", "-P", "2", "-H", "4",
                            "--require-signatures", "--admin-key", str(admin)])
    assert r.exit_code == 0, r.output
    run = ledger.read_run(open_store(url))
    assert run["require_signatures"] is True and records.SIGNATURES in run["features"]
    assert run["admin_key"] == signing.load_key(admin).public_key
    r = runner.invoke(app, ["admit", url, "a", pub, "--admin-key", str(admin)])
    assert r.exit_code == 0, r.output
    ring = signing.KeyRing(open_store(url), run=run)
    ring.refresh()
    assert ring.keys_of("a", role="learner") == (pub,)
    r = runner.invoke(app, ["admit", url, "b", pub, "--admin-key", str(key_path)])  # a learner's key is not the admin's
    assert r.exit_code == 2 and "not the run's" in r.output
    r = runner.invoke(app, ["admit", url, "b", pub, "--admin-key", str(tmp_path / "nope.pem")])
    assert r.exit_code == 2 and "no such file" in r.output
    # revocation (issue 25): only with the admin key, only an admitted id; then a's key is refused
    r = runner.invoke(app, ["admit", url, "a", "--revoke", "--admin-key", str(key_path)])
    assert r.exit_code == 2 and "not the run's" in r.output
    r = runner.invoke(app, ["admit", url, "a", pub, "--revoke", "--admin-key", str(admin)])
    assert r.exit_code == 2 and "no PUBKEY" in r.output
    r = runner.invoke(app, ["admit", url, "zz", "--revoke", "--admin-key", str(admin)])
    assert r.exit_code == 2 and "not admitted" in r.output
    r = runner.invoke(app, ["admit", url, "a", "--revoke", "--admin-key", str(admin)])
    assert r.exit_code == 0 and "revoked a" in r.output, r.output
    ring.refresh()
    assert ring.keys_of("a", role="learner") == ()


def test_keys_list_admit_from_file_and_inspect_show_the_admissions(keys, tmp_path):
    """Issue 26 item 5: `keys list` (and `inspect`) show id, role, key fingerprint and when
    admitted, and whether the run requires signatures; `admit --from-file` admits a fleet."""
    runner = CliRunner()
    url = str(tmp_path / "run")
    admin = tmp_path / "admin.pem"
    r = runner.invoke(app, ["init", url, "--task", "ddiloco_cli.tasks.gpt:tiny", "-P", "2", "-H", "4",
                            "--require-signatures", "--admin-key", str(admin)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["keys", "list", url])
    assert r.exit_code == 0 and "no key admitted yet" in r.output, r.output
    fleet = tmp_path / "fleet.txt"
    fleet.write_text(f"# fleet\na {keys['a'].public_key}\n\nsync1 {keys['syncer'].public_key} syncer  # the syncer\n")
    r = runner.invoke(app, ["admit", url, "--from-file", str(fleet), "--admin-key", str(admin)])
    assert r.exit_code == 0 and "admitted learner a" in r.output and "admitted syncer sync1" in r.output, r.output
    r = runner.invoke(app, ["keys", "list", url, "--json"])
    listed = json.loads(r.stdout)
    assert listed["require_signatures"] is True
    assert [(a["id"], a["role"], a["fingerprint"], a["problem"]) for a in listed["admissions"]] == [
        ("a", "learner", keys["a"].public_key[:16], None), ("sync1", "syncer", keys["syncer"].public_key[:16], None)]
    assert all(a["admitted_s"] > 0 for a in listed["admissions"])
    r = runner.invoke(app, ["keys", "list", url], terminal_width=200)
    assert "signatures required" in r.output and keys["a"].public_key[:16] in r.output and "sync1" in r.output
    r = runner.invoke(app, ["inspect", url], terminal_width=200)
    assert "admissions (signatures required; 2)" in r.output and keys["syncer"].public_key[:16] in r.output
    # a forged admission (signed by a's own key) is listed with its problem
    store = open_store(url)
    run = ledger.read_run(store)
    signing.admit(store, run={**run, "admin_key": keys["b"].public_key}, member_id="b",
                  public_key=keys["b"].public_key, role="learner", admin=keys["b"])
    r = runner.invoke(app, ["keys", "list", url, "--json"])
    (forged,) = [a for a in json.loads(r.stdout)["admissions"] if a["id"] == "b"]
    assert forged["problem"]
    for bad, needle in ((f"a {keys['a'].public_key} admin\n", "want `ID PUBKEY"), ("a nothex\n", "public key"),
                        ("\n# nothing\n", "no `ID PUBKEY` line")):
        fleet.write_text(bad)
        r = runner.invoke(app, ["admit", url, "--from-file", str(fleet), "--admin-key", str(admin)])
        assert r.exit_code == 2 and needle in r.output, r.output
    r = runner.invoke(app, ["admit", url, "--admin-key", str(admin)])
    assert r.exit_code == 2 and "give ID PUBKEY, or --from-file FILE" in r.output


def test_wait_for_admission_makes_the_key_says_the_command_and_returns_once_admitted(keys, tmp_path):
    from ddiloco_cli.ops.admission import wait_for_admission

    store = open_store(f"memory://{uuid.uuid4().hex}")
    run = {"run_id": RUN, "require_signatures": True, "admin_key": keys["admin"].public_key}
    said, slept = [], []
    key_path = tmp_path / "fresh" / "a.pem"

    def sleep(s):  # the admin admits the key while the learner waits
        slept.append(s)
        if len(slept) == 2:
            signing.admit(store, run=run, member_id="a", public_key=signing.load_key(key_path).public_key,
                          role="learner", admin=keys["admin"])

    wait_for_admission(store, run=run, member_id="a", key_path=str(key_path), timeout_s=float("inf"),
                       say=said.append, sleep=sleep)
    pub = signing.load_key(key_path).public_key
    assert f"ddiloco admit {store.url} a {pub}" in said[0] and said[-1] == "learner a admitted"
    assert slept == [1.0, 2.0]
    with pytest.raises(UsageError, match="not admitted within 3 s"):
        wait_for_admission(store, run=run, member_id="b", key_path=str(tmp_path / "b.pem"), timeout_s=3,
                           say=said.append, sleep=lambda s: None, monotonic=iter(range(0, 100, 2)).__next__)
    wait_for_admission(store, run={"run_id": RUN}, member_id="c", key_path=None, timeout_s=1, say=said.append)


def test_unsigned_run_lists_no_admissions(tmp_path):
    url = str(tmp_path / "run")
    assert CliRunner().invoke(app, ["init", url, "--task", "ddiloco_cli.tasks.gpt:tiny", "-P", "2", "-H", "4"]).exit_code == 0
    r = CliRunner().invoke(app, ["keys", "list", url])
    assert r.exit_code == 0 and "signatures: not required" in r.output


def test_local_init_does_not_require_signatures_by_default(tmp_path):
    url = str(tmp_path / "run")
    r = CliRunner().invoke(app, ["init", url, "--task", "ddiloco_cli.tasks.gpt:tiny", "-P", "2", "-H", "4"])
    assert r.exit_code == 0, r.output
    run = ledger.read_run(open_store(url))
    assert not signing.requires_signatures(run) and "admin_key" not in run and run["features"] == []
    signing.new_key(tmp_path / "x.pem")
    r = CliRunner().invoke(app, ["admit", url, "a", "0" * 64, "--admin-key", str(tmp_path / "x.pem")])
    assert r.exit_code != 0 and "no valid admin_key" in r.output


def test_signed_message_known_answer_A6():
    """The signed bytes, spelled out for other implementations: a fixed key and record
    give this exact signature (ed25519 is deterministic)."""
    import hashlib
    import struct

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    signer = signing.Signer.from_private(Ed25519PrivateKey.from_private_bytes(bytes(range(32))))
    rec = {"format": "ddiloco.learner_heartbeat", "protocol_version": 1, "run_id": "r", "learner_id": "a",
           "state": "running", "step": 1, "tokens": 2}
    key = "learners/a/heartbeat.json"
    canonical = b'{"format":"ddiloco.learner_heartbeat","learner_id":"a","protocol_version":1,"run_id":"r",' \
                b'"state":"running","step":1,"tokens":2}\n'
    fields = [b"ddiloco.learner_heartbeat", b"r", key.encode(), signer.public_key.encode()]
    expected = b"ddiloco signature v1\n" + b"".join(struct.pack(">I", len(f)) + f for f in fields) \
        + hashlib.sha256(canonical).digest()
    assert signing.message(kind=rec["format"], run_id="r", key=key, public_key=signer.public_key,
                           digest=hashlib.sha256(canonical).digest()) == expected
    signed = signing.sign_record(rec, run_id="r", key=key, signer=signer)
    assert signer.public_key == "03a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8"
    assert signed["signature"] == {
        "alg": "ed25519", "key": signer.public_key,
        "sig": "582e9770886f776bdb37548ee11511683ab1cbb15975b8e04f491c4f62f7f86e"
               "3e5be1f489d9cc3d8fc0174b7d706ce41a8fb6ca8551d589daf48294c5a35500"}


def test_signer_for_run_fails_at_start_without_an_admitted_key_A1(keys, tmp_path):
    store = open_store(f"memory://{uuid.uuid4().hex}")
    run = _signed_run(store, keys["admin"])
    assert signing.signer_for_run(store, run={"run_id": RUN}, key_path=None, member_id="a", role="learner") is None
    with pytest.raises(UsageError, match="requires signatures: pass --key"):
        signing.signer_for_run(store, run=run, key_path=None, member_id="a", role="learner")
    with pytest.raises(UsageError, match="has no key admitted.*ddiloco admit"):
        signing.signer_for_run(store, run=run, key_path=tmp_path / "a.pem", member_id="a", role="learner")
    signing.admit(store, run=run, member_id="a", public_key=keys["a"].public_key, role="learner", admin=keys["admin"])
    assert signing.signer_for_run(store, run=run, key_path=tmp_path / "a.pem", member_id="a",
                                  role="learner").public_key == keys["a"].public_key
    with pytest.raises(UsageError, match="has key .* admitted"):  # b's key presented as a's
        signing.signer_for_run(store, run=run, key_path=tmp_path / "b.pem", member_id="a", role="learner")
    with pytest.raises(UsageError, match="syncer 'a' has no key"):  # admitted as a learner, not a syncer
        signing.signer_for_run(store, run=run, key_path=tmp_path / "a.pem", member_id="a", role="syncer")
    with pytest.raises(UsageError, match="is not admitted as a syncer key"):  # syncers are not named
        signing.signer_for_run(store, run=run, key_path=tmp_path / "a.pem", member_id=None, role="syncer")


# ------------------------------------------------------------------------ status
def test_status_lists_only_verified_learners_A3(keys, tmp_path):
    from ddiloco_cli.ops.observe import run_status
    from ddiloco_cli.ops.runinit import RunSpec, init_run

    store = open_store(str(tmp_path / "run"))
    run = init_run(store, RunSpec(task="ddiloco_cli.tasks.gpt:tiny", num_fragments=2, sync_every=4), admin=keys["admin"])
    signing.admit(store, run=run, member_id="a", public_key=keys["a"].public_key, role="learner", admin=keys["admin"])
    for learner_id, signer in (("a", keys["a"]), ("fake", None)):
        rec = records.make("learner_heartbeat", run_id=run["run_id"], learner_id=learner_id, state="running", step=1,
                           tokens=1)
        key = layout.learner_heartbeat_key(learner_id)
        if signer is not None:
            rec = signing.sign_record(rec, run_id=run["run_id"], key=key, signer=signer)
        store.put(key, records.dumps(rec))
    status = run_status(store)
    assert [r["learner_id"] for r in status["learners"]] == ["a"]
    assert any("learner fake: heartbeat not signed" in e for e in status["errors"])


def test_a_learner_and_a_syncer_load_cryptography_only_when_a_key_is_used():
    """cryptography is imported on first use (4.5 MB of every process's memory otherwise)."""
    import subprocess
    import sys

    code = ("import sys, torch; import ddiloco_cli.learner.learn, ddiloco_cli.syncer.core; "
            "print('cryptography' in sys.modules); from ddiloco_cli.protocol import signing; "
            "signing.parse_public_key('ab' * 32); print('cryptography' in sys.modules); "
            "signing._ed25519(); print('cryptography' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "False", "True"]
