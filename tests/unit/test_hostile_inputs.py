"""Hostile bucket content (issue 9, findings 1, 3 and 10; PROTOCOL.md [R7], [F4], [V2]).

Whoever can write the bucket can put any bytes at any key. Nothing there may crash
a reader with a traceback, stall a syncer, or stop it from committing the other
fragments: every reader parses bucket JSON through ``records.parse_json`` (bounded
bytes, depth and integer digits; finite numbers only) and reports a bad object as
ProtocolError / InvalidPayloadError naming it.

Part 1 builds each parser bomb by hand; part 2 is the epoch-claim loop (junk and
newer-protocol epochs, also on S3: tests/integration/test_hostile_epochs.py); part 3
learner ids; part 4 (``test_fuzz_*``) lets hypothesis write random bytes and
mutated valid objects at every key a reader touches.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddiloco_cli.errors import InvalidPayloadError, ProtocolError
from ddiloco_cli.numerics import codec
from ddiloco_cli.protocol import layout, ledger, records
from ddiloco_cli.store import open_store
from ddiloco_cli.syncer.core import Syncer, SyncerOptions

from support.hostile import DEEP, nested, one_error, run_cli
from support.runs import beat, contribution, live_syncer, make_run, step

# ============================================================ 1. parser bombs
BOMBS = {
    "nested array": nested(DEEP).encode(),
    "nested in a field": ('{"format":"ddiloco.epoch","x":' + nested(DEEP) + "}").encode(),
    "nested objects": ('{"a":' * 5000 + "1" + "}" * 5000).encode(),
    "5000-digit integer": ('{"epoch":' + "9" * 5000 + "}").encode(),
    "float overflow": b'{"created_s":1e400}',
    "NaN": b'{"created_s":NaN}',
    "Infinity": b'{"created_s":-Infinity}',
    "bad utf-8": b'{"a":"\xff\xfe"}',
    "utf-16": nested(DEEP).encode("utf-16"),
    "not json": b"\x00\x01garbage",
}


@pytest.mark.parametrize("name", BOMBS)
def test_parse_json_turns_every_bomb_into_protocol_error_R7(name):
    """[R7] the one bounded parser raises ProtocolError naming where, never RecursionError,
    ValueError or OverflowError."""
    with pytest.raises(ProtocolError, match=r"^bucket/some\.json: not valid JSON \(") as info:
        records.parse_json(BOMBS[name], where="bucket/some.json")
    assert "\n" not in str(info.value) and len(str(info.value)) < 300


def test_parse_json_bounds_are_exact_R7():
    """[R7] depth MAX_JSON_DEPTH and MAX_INT_DIGITS digits parse; one more does not; brackets
    inside strings do not count; the byte bound is checked before parsing."""
    d = records.MAX_JSON_DEPTH
    assert records.parse_json(nested(d), where="x") is not None
    with pytest.raises(ProtocolError, match="nested"):
        records.parse_json(nested(d + 1), where="x")
    assert records.parse_json(json.dumps({"s": "[[[[{{{{" * 100 + '\\"]]'}), where="x")["s"].startswith("[[[[")
    digits = "9" * records.MAX_INT_DIGITS
    assert records.parse_json(digits, where="x") == int(digits)
    with pytest.raises(ProtocolError, match="digits"):
        records.parse_json(digits + "9", where="x")
    with pytest.raises(ProtocolError, match="exceed the bound of 10"):
        records.parse_json(b" " * 11, where="x", max_bytes=10)


def _hooked(raw: bytes):
    """The reference: every number through parse_json's hooks (what it did for every record
    before its fast path)."""
    try:
        return "ok", json.loads(raw.decode("utf-8"), parse_int=records._parse_int, parse_float=records._parse_float,
                                parse_constant=records._parse_constant)
    except records.PARSE_ERRORS:
        return "error", None


def _depth(value) -> int:
    """Nesting depth of a parsed value (its containers'), as parse_json bounds it."""
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def _same(a, b) -> bool:
    """Equal values of equal types all the way down (1 is not 1.0 here)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


_EDGE_NUMBERS = ["9" * 19, "9" * 20, "9" * 21, "-" + "9" * 19, "-" + "9" * 20, "1e99", "1e100", "1e308", "1e309",
                 "-1e-05", "1e-300", "1E+400", "2.5e-07", "0." + "1" * 30, "1" * 25 + ".5", "0", "-0", "-0.0",
                 "12345678901234567890.5", "1.7976931348623157e308", "NaN", "-Infinity", "Infinity", "true", "null"]
_EDGE_STRINGS = ['"a"', '"00000000000000000003.json"', '"e540e700"', '"NaN Infinity 1e999"', '"q\\"uote"',
                 '"back\\\\slash"', '"' + "9" * 30 + '"', '"-' + "1" * 21 + '"', '"\\u0041"', '"[[{{"',
                 '"' + "[{" * 40 + '"']


def _check_fast_path(raw: bytes) -> None:
    """parse_json as it reads small records (the hooks) and large ones (the numbers checked on
    the text: here at any size) against the reference."""
    want = _hooked(raw)
    if want[0] == "ok" and _depth(want[1]) > records.MAX_JSON_DEPTH:
        want = ("error", None)  # (too deep for parse_json, whatever the numbers)
    default = records.UNHOOKED_MIN_BYTES
    for threshold in (0, default):
        records.UNHOOKED_MIN_BYTES = threshold
        try:
            got = ("ok", records.parse_json(raw, where="x"))
        except ProtocolError:
            got = ("error", None)
        finally:
            records.UNHOOKED_MIN_BYTES = default
        assert got[0] == want[0] and _same(got[1], want[1]), (raw, threshold)


@pytest.mark.parametrize("edge", _EDGE_NUMBERS + _EDGE_STRINGS)
def test_parse_json_fast_path_at_each_edge_R7(edge):
    """[R7] each edge value alone, in an array and as an object's value (beside a string that
    would send the parse the slow way and one that would not)."""
    for doc in (edge, f"[{edge}]", f'{{"k": {edge}, "s": "x"}}', f'[1, {edge}, "00000000000000000001"]'):
        _check_fast_path(doc.encode())


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.recursive(st.sampled_from(_EDGE_NUMBERS + _EDGE_STRINGS)
                    | st.integers(min_value=-10**25, max_value=10**25).map(str)
                    | st.floats(allow_nan=False, allow_infinity=False).map(repr),
                    lambda inner: st.lists(inner, max_size=4).map(lambda xs: "[" + ",".join(xs) + "]")
                    | st.dictionaries(st.sampled_from(['"a"', '"b"', '"k 1"', '"e100"']), inner, max_size=4).map(
                        lambda d: "{" + ", ".join(f"{k}: {v}" for k, v in d.items()) + "}"),
                    max_leaves=12))
def test_parse_json_fast_path_gives_what_the_hooks_give_R7(doc):
    """[R7] JSON whose numbers the C scanner may parse alone (``records._plain_numbers``) gives
    exactly the values the hooked parse gives, and JSON it may not is refused or accepted as the
    hooks decide: digit runs, exponents, NaN and Infinity at the bounds and inside strings,
    escaped quotes and backslashes."""
    _check_fast_path(doc.encode())


def test_schemas_bound_every_integer_R7():
    """[R7] every integer field of every schema has a maximum (at most 2**53 - 1), so no
    accepted number overflows a float; c_tokens**2 / c_steps stays finite."""
    from importlib import resources

    def integers(node, path):
        if isinstance(node, dict):
            types = node.get("type") if isinstance(node.get("type"), list) else [node.get("type")]
            if "integer" in types:
                yield path, node
            for k, v in node.items():
                yield from integers(v, f"{path}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                yield from integers(v, f"{path}/{i}")

    found = 0
    for record_type in records.RECORD_TYPES:
        schema = json.loads(resources.files("ddiloco_cli").joinpath(f"schemas/{record_type}.schema.json").read_text())
        for path, node in integers(schema, record_type):
            found += 1
            assert node.get("maximum", float("inf")) <= records.MAX_SAFE_INT, path
    assert found > 50
    c = json.loads(resources.files("ddiloco_cli").joinpath("schemas/contribution.schema.json").read_text())
    max_tokens = c["properties"]["c_tokens"]["maximum"]
    assert float(max_tokens) ** 2 / 1 < float("inf")


def _payload_with_description(description: str) -> bytes:
    """A payload whose 'ddiloco' metadata entry is ``description`` verbatim."""
    data = codec.encode_tensors({"a": torch.zeros(4)}, codec="none", metadata={})
    hlen = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + hlen])
    header["__metadata__"]["ddiloco"] = description
    hbytes = json.dumps(header).encode()
    return len(hbytes).to_bytes(8, "little") + hbytes + data[8 + hlen:]


def _payload_with_header_field(raw_json_value: str) -> bytes:
    """A payload whose safetensors header gains a field holding ``raw_json_value`` verbatim."""
    data = codec.encode_tensors({"a": torch.zeros(4)}, codec="none", metadata={})
    hlen = int.from_bytes(data[:8], "little")
    hbytes = data[8:8 + hlen].rstrip() [:-1] + b',"x":' + raw_json_value.encode() + b"}"
    return len(hbytes).to_bytes(8, "little") + hbytes + data[8 + hlen:]


@pytest.mark.parametrize("make", [
    lambda: _payload_with_header_field(nested(DEEP)),
    lambda: _payload_with_header_field("9" * 5000),
    lambda: _payload_with_description(nested(DEEP)),
    lambda: _payload_with_description('{"format":1,"codec":"none","tensors":{},"metadata":{"n":' + "1" * 5000 + "}}"),
    lambda: _payload_with_description('{"format":1,"codec":"none","tensors":{},"metadata":{"n":1e999}}'),
    lambda: _payload_with_description('{"format":1,"codec":"none","tensors":{"a":{"shape":[' + ",".join(["99999999999999999999"] * 8) + '],"raw_nbytes":1,"comp_nbytes":1}},"metadata":{}}'),
])
def test_payload_parser_bombs_are_invalid_payloads_R7(make):
    """[R7] a nested or huge-integer safetensors header or 'ddiloco' metadata is an
    InvalidPayloadError naming the payload, for decode and for `inspect`'s header read."""
    data = make()
    with pytest.raises(InvalidPayloadError, match=r"^contributions/x: "):
        codec.decode_tensors(data, where="contributions/x")
    if b"99999999999999999999" not in data:  # that one parses; only decoding it is refused
        with pytest.raises(InvalidPayloadError, match=r"^contributions/x: "):
            codec.payload_codec(data, where="contributions/x")


@pytest.fixture
def local_run(store_url):
    store = open_store(store_url("local"))
    make_run(store)
    return store


@pytest.mark.parametrize("c_tokens", [10**400, 10**200, 2**60], ids=["10**400", "10**200", "2**60"])
def test_huge_counters_are_quarantined_and_others_commit_V2(local_run, c_tokens):
    """[V2][R7] c_tokens = 10**400 (OverflowError before), 10**200 (an inf weight before)
    or 2**60 (over the schema's bound): quarantined; the other fragment commits; a
    restarted syncer serves."""
    store = local_run
    beat(store, "a")
    s = live_syncer(store)
    bad_key, _, _ = contribution(store, 0, "a", 1, c_tokens=c_tokens)
    contribution(store, 1, "a", 2)
    s.poll_contributions()
    assert not s.maybe_merge(s.states[0])
    assert s.maybe_merge(s.states[1])
    report = records.loads(store.get(layout.quarantine_key(bad_key)), "quarantine", where="q")
    assert "c_tokens" in report["reason"] or "digits" in report["reason"]
    restarted = Syncer(store, options=SyncerOptions(syncer_id="again", gc=False))
    restarted.restore()
    assert restarted.states[1].version == 1 and restarted.states[0].version == 0


@pytest.mark.parametrize("body", [
    ('{"format":"ddiloco.learner_heartbeat","protocol_version":1,"learner_id":"b","state":"running",'
     '"step":1,"tokens":1,"x":' + nested(DEEP) + "}"),
    ('{"format":"ddiloco.learner_heartbeat","protocol_version":1,"learner_id":"b","state":"running",'
     '"step":1,"tokens":' + "7" * 5000 + "}"),
    ('{"format":"ddiloco.learner_heartbeat","protocol_version":1,"learner_id":"b","state":"running",'
     '"step":1,"tokens":1,"step_time_s":1e400}'),
])
def test_hostile_learner_heartbeat_is_skipped_and_syncer_commits_R7(local_run, body):
    """[R7] nested or huge-number JSON in a learner's heartbeat.json: the syncer skips that
    heartbeat and keeps committing the other learners' contributions."""
    store = local_run
    beat(store, "a")
    store.put(layout.learner_heartbeat_key("b"), body.encode())
    s = live_syncer(store)
    s._refresh_learners()
    assert s.known_learners == {"a"}
    contribution(store, 0, "a", 1)
    assert step(s, 0)
    beats = ledger.read_heartbeats(store, layout.LEARNER_HEARTBEAT_PREFIX, "learner_heartbeat")
    assert [b.record["learner_id"] for b in beats] == ["a"]


@pytest.mark.parametrize("run_id", ["[/]", "a\nb", "[bold red]x"])
def test_bucket_text_in_messages_is_one_line_not_markup_R7(local_run, monkeypatch, capsys, run_id):
    """[R7] a plan naming run "[/]" (rich markup) or "a\nb" (a newline): `sync` and `status`
    print one escaped error line (the markup crashed the CLI's error printer before)."""
    store = local_run
    plan = json.loads(store.get(layout.PLAN))
    plan["run_id"] = run_id
    os.replace(os.path.join(store.root, layout.PLAN), os.path.join(store.root, "plan.bak"))
    store.put(layout.PLAN, json.dumps(plan).encode())
    for command in (["sync", store.url, "--max-runtime", "5"], ["status", store.url]):
        code, out = run_cli(monkeypatch, capsys, *command)
        assert code == ProtocolError.exit_code and one_error(out, naming="belongstorun"), out
        assert len(out.strip().splitlines()) == 1 and run_id.replace("\n", "\\n") in out, out


@pytest.mark.parametrize("key", [layout.RUN_CONFIG, layout.PLAN, layout.epoch_key(1)])
@pytest.mark.parametrize("body", [nested(DEEP), '{"num_fragments":' + "1" * 5000 + "}"])
def test_sync_status_inspect_report_hostile_run_files_in_one_line_R7(local_run, monkeypatch, capsys, key, body):
    """[R7] nested or huge-integer run.json, plan.json or epoch file: `sync`, `status` and
    `inspect` print one error line (or report the file), never a traceback."""
    store = local_run
    if key == layout.epoch_key(1):  # a syncer claimed epoch 1 and exited; then its claim was overwritten
        store.put(layout.epoch_key(1), body.encode())
    else:
        os.replace(os.path.join(store.root, key), os.path.join(store.root, key + ".bak"))
        store.put(key, body.encode())
    url = store.url
    if key == layout.epoch_key(1):
        # the syncer must claim and serve: it stops after its first commit (an event), not after a fixed
        # --max-runtime that a loaded machine spends before the claim; the runtime is only a ceiling
        beat(store, "a")
        contribution(store, 0, "a", 1)
        limits = ["--max-versions", "1", "--max-runtime", "120"]
    else:
        limits = ["--max-runtime", "0.5"]  # it fails at once, reading the file
    code, out = run_cli(monkeypatch, capsys, "sync", url, *limits, "--no-gc", "--poll", "0.05")
    if key == layout.epoch_key(1):
        assert code == 0, out  # the junk claim is skipped: the syncer claims epoch 2 and serves
        assert ledger.latest_version(store, 0) == 1, out
        assert ledger.list_epochs(store, run_id=ledger.read_run(store)["run_id"])[-1].epoch == 2
    else:
        assert code != 0 and one_error(out, naming=key), out
    for command in (["status", url], ["inspect", url], ["inspect", url, "--verify"]):
        code, out = run_cli(monkeypatch, capsys, *command)
        assert "Traceback" not in out
        assert key in "".join(out.split()), (command, out)


def test_unreadable_fragment_is_left_out_and_retried_V1(local_run, monkeypatch):
    """[V1] a fragment whose committed value cannot be read (a corrupt payload of its latest
    version) does not stop the syncer: the other fragment commits, and once the object is
    repaired the next retry restores the fragment and it commits too."""
    import ddiloco_cli.syncer.core as syncer_module

    store = local_run
    beat(store, "a")
    key = ledger.read_manifest(store, 0, 0)["payloads"][0]["key"]
    original = store.get(key)
    store.put(key, b"\x00" * 16)
    contribution(store, 0, "a", 1)
    contribution(store, 1, "a", 2)
    monkeypatch.setattr(syncer_module, "RESTORE_RETRY_S", 0.0)

    def repair_after_fragment_1_commits(progress: dict) -> None:
        if progress["versions"].get(1) == 1:
            store.put(key, original)

    s = Syncer(store, options=SyncerOptions(syncer_id="s", gc=False, poll_s=0.01, max_versions=2),
               on_progress=repair_after_fragment_1_commits)
    assert s.serve() == "limit"
    assert [ledger.latest_version(store, p) for p in (0, 1)] == [1, 1]
    assert s.unavailable == {}


# ============================================================ 2. the epoch claim
class _AlwaysTaken:
    """A store whose every create finds the key taken although LIST does not show it:
    the worst case for a claim loop."""

    def __init__(self, inner):
        self.inner, self.url, self.creates = inner, inner.url, 0

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self.creates += 1
        return False

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_claim_loop_honours_stop_F4(local_run):
    """[F4] the claim retries only while stop() is false, then returns None; the syncer's
    acquire passes its stop through and reports it did not claim."""
    store = _AlwaysTaken(local_run)
    run_id = ledger.read_run(local_run)["run_id"]
    calls = iter(range(1000))
    assert ledger.claim_epoch(store, run_id=run_id, syncer_id="s", fragments=[0], created_s=0.0,
                              stop=lambda: next(calls) >= 3) is None
    assert store.creates == 3
    s = Syncer(store, options=SyncerOptions(syncer_id="s", gc=False))
    deadline = time.monotonic() + 60
    assert not s.acquire(stop=lambda: store.creates >= 5 or time.monotonic() > deadline)
    assert store.creates == 5 and s.epoch is None


def test_standby_honours_max_runtime_F4(store_url):
    """[F4] a standby behind a live owner stops at --max-runtime ("limit") without claiming."""
    store = open_store(store_url("local"))
    make_run(store, lease_s=600.0)
    owner = live_syncer(store, syncer_id="owner")
    owner.heartbeat(force=True)
    standby = Syncer(store, options=SyncerOptions(syncer_id="standby", gc=False, max_runtime_s=0.2))
    assert standby.serve() == "limit"
    assert standby.epoch is None
    assert [e.syncer_id for e in ledger.list_epochs(store, run_id=owner.run_id)] == ["owner"]


def test_epoch_numbers_beyond_the_schema_are_not_epochs_F4(local_run):
    """[F4] an object named like epoch 10**20 - 1 (above 2**53) is no epoch: the next claim
    stays a 20-digit, schema-valid number; at 2**53 - 1 the claim stops with a message."""
    store = local_run
    run_id = ledger.read_run(store)["run_id"]
    store.put(layout.epoch_key(10**20 - 1), b"{}")
    assert ledger.claim_epoch(store, run_id=run_id, syncer_id="s", fragments=[0], created_s=0.0).epoch == 1
    store.put(layout.epoch_key(records.MAX_SAFE_INT), b"{}")
    with pytest.raises(ProtocolError, match="no epoch number is left"):
        ledger.claim_epoch(store, run_id=run_id, syncer_id="s", fragments=[0], created_s=0.0)


# ============================================================ 3. learner ids
@pytest.mark.parametrize("learner_id", ["a\n", "a\n\n", "\na", "a/b", "", "-a", "a" * 65, "é", "a b", "a\x00"])
def test_learner_id_is_fullmatched_everywhere_V2(learner_id):
    """[V2] a trailing newline (accepted by `$` before), a slash, a space... is no learner id:
    not for layout, not for the schemas, not as a contribution key the syncer would accept."""
    assert not layout.valid_learner_id(learner_id)
    rec = records.make("learner_heartbeat", run_id="r", learner_id=learner_id, state="running", step=0, tokens=0)
    with pytest.raises(ProtocolError, match="learner_id"):
        records.validate(rec, "learner_heartbeat", where="hb")
    assert layout.key_kind(f"contributions/p00000/{learner_id}/{layout.num(1)}.safetensors") is None


def test_learner_id_grammar_is_written_once():
    """The learner-id regex lives in layout.py only: no schema or module repeats it."""
    from pathlib import Path

    root = Path(layout.__file__).parent
    hits = [str(p.relative_to(root)) for p in root.rglob("*") if p.suffix in (".py", ".json")
            and "A-Za-z0-9_.-" in p.read_text()]
    assert hits == ["layout.py"], hits


def test_key_grammar_parsers_roundtrip():
    """layout's parse helpers invert its key builders and refuse near-misses (fullmatch, ASCII digits)."""
    ck = layout.checkpoint_key(3, 12, "abc123")
    assert layout.parse_checkpoint_key(ck) == (3, 12)
    assert layout.parse_checkpoint_key(ck + "\n") is None
    key = layout.contribution_key(2, "alice", 9)
    assert layout.parse_contribution_key(key) == (2, "alice", 9)
    assert layout.parse_quarantine_key(layout.quarantine_key(key)) == key
    assert layout.parse_quarantine_key("quarantine/.json") is None
    assert layout.parse_num("\u0661" * 20) is None  # Arabic-Indic digits: isdigit() but not ours
    assert layout.key_kind(layout.manifest_key(7, 3)) == ("manifests", 7)
    assert layout.key_kind(layout.syncer_heartbeat_key(3)) == ("heartbeats", None)
    assert layout.key_kind("fragments/p00001/manifests/x.json") is None
    assert layout.key_kind(layout.learner_heartbeat_key("alice")) == ("heartbeats", None)
    assert layout.parse_learner_heartbeat_key(layout.learner_heartbeat_key("alice")) == "alice"
    assert layout.parse_learner_heartbeat_key("learners/a\n/heartbeat.json") is None
    assert layout.tensor_fragment(layout.checkpoint_key(4, 1, "n")) == 4
    assert layout.tensor_fragment("contributions/p00002/anything") == 2
    assert layout.tensor_fragment(layout.manifest_key(2, 1)) is None
    assert layout.is_latest_hint_key(layout.latest_hint_key(3)) and not layout.is_latest_hint_key("fragments/p3/latest.json")


def test_heartbeat_naming_another_learner_is_skipped_R1(local_run):
    """[R1] a heartbeat at learners/mallory/ that claims to be alice's does not make alice
    known or live (nor does one at a key that names no learner)."""
    store = local_run
    run_id = ledger.read_run(store)["run_id"]
    alice = records.make("learner_heartbeat", run_id=run_id, learner_id="alice", state="running", step=1, tokens=1)
    store.put(layout.learner_heartbeat_key("mallory"), records.dumps(alice))
    store.put("learners/x y/heartbeat.json", records.dumps(alice))
    assert ledger.read_heartbeats(store, layout.LEARNER_HEARTBEAT_PREFIX, "learner_heartbeat") == []
    beat(store, "alice")
    beats = ledger.read_heartbeats(store, layout.LEARNER_HEARTBEAT_PREFIX, "learner_heartbeat")
    assert [b.key for b in beats] == [layout.learner_heartbeat_key("alice")]


# ============================================================ 4. the fuzzer
# A run with history (3 versions per fragment, deltas, a keyframe, a checkpoint, a
# quarantine report) is built once; each example copies it, writes random bytes or a
# mutated copy of the valid object at one key a reader touches, and runs every reader.
HONEST, HOSTILE = "alice", "mallory"
SENTINEL = "\u2603hostile\u2603"
HOSTILE_JSON = [nested(DEEP), nested(40), "9" * 5000, "1e999", "-1", str(2**63), '"' + "x" * 20000 + '"',
                "null", "[]", "{}", "true", '"a\\n"', "0.5", '"\\u0000"', '"[/]"', '"[bold]"']


def _template_keys(store) -> dict[str, str]:
    """The keys the fuzzer targets, by the name of what lives there."""
    def newest(prefix: str, suffix: str = "") -> str:
        return [i.key for i in store.list(prefix) if i.key.endswith(suffix)][-1]

    return {
        "run": layout.RUN_CONFIG, "plan": layout.PLAN,
        "latest manifest": layout.manifest_key(0, 3), "older manifest": layout.manifest_key(0, 1),
        "latest delta": newest(layout.payload_prefix(0), ".safetensors"),
        "keyframe": [i.key for i in store.list(layout.payload_prefix(0)) if "-full-" in i.key][-1],
        "latest hint": layout.latest_hint_key(0), "checkpoint": newest(layout.checkpoint_prefix(0)),
        "pending contribution": layout.contribution_key(0, HOSTILE, 10**15),
        "honest contribution": layout.contribution_key(0, HONEST, 10**15 + 1),
        "epoch": layout.epoch_key(1), "next epoch": layout.epoch_key(2),
        "syncer heartbeat": layout.syncer_heartbeat_key(1),
        "learner heartbeat": layout.learner_heartbeat_key(HOSTILE),
        "quarantine report": newest(layout.QUARANTINE_PREFIX),
    }


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    store = open_store(str(tmp_path_factory.mktemp("fuzz") / "run"))
    make_run(store, checkpoint_every=2, keyframe_every=2, max_staleness=4)
    beat(store, HONEST)
    s = live_syncer(store, syncer_id="template")
    for v in range(3):
        for p in (0, 1):
            contribution(store, p, HONEST, 100 + 10 * v + p, base_version=v)
            assert step(s, p)
    beat(store, HOSTILE)
    contribution(store, 1, HOSTILE, 5, c_tokens=-1)  # quarantined: gives the run a report
    s.poll_contributions()
    s.heartbeat(force=True, state="stopped")
    contribution(store, 0, HOSTILE, 10**15, base_version=3)
    contribution(store, 0, HONEST, 10**15 + 1, base_version=3)
    # a latest hint as ddiloco 0.1 wrote it (retired; old buckets still hold them): readers ignore it
    store.put(layout.latest_hint_key(0), records.dumps(records.make("latest", fragment=0, version=3)))
    keys = _template_keys(store)
    assert all(store.list(k) for k in keys.values() if k != layout.epoch_key(2)), keys
    return store.root, keys


def _mutate_json(original: bytes, data: st.DataObject) -> bytes:
    """The object with one value (at a random path) replaced by a hostile JSON literal."""
    value = json.loads(original)
    node, path = value, []
    while isinstance(node, (dict, list)) and node and data.draw(st.booleans(), label="descend"):
        key = data.draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
        path.append(key)
        node = node[key]
    hostile = data.draw(st.sampled_from(HOSTILE_JSON), label="value")
    if not path:
        return hostile.encode()
    parent = value
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = SENTINEL
    return json.dumps(value).replace(json.dumps(SENTINEL), hostile).encode()


def _mutate_payload(original: bytes, data: st.DataObject) -> bytes:
    """A safetensors payload with its header or 'ddiloco' metadata mutated, or its bytes cut or flipped."""
    hlen = int.from_bytes(original[:8], "little")
    how = data.draw(st.sampled_from(["header", "metadata", "truncate", "flip"]), label="how")
    if how == "truncate":
        return original[: data.draw(st.integers(0, len(original) - 1), label="cut")]
    if how == "flip":
        i = data.draw(st.integers(0, len(original) - 1), label="at")
        return original[:i] + bytes([original[i] ^ data.draw(st.integers(1, 255), label="xor")]) + original[i + 1:]
    header_bytes = original[8:8 + hlen]
    if how == "header":
        new_header = _mutate_json(header_bytes, data)
    else:
        header = json.loads(header_bytes)
        description = header["__metadata__"]["ddiloco"].encode()
        header["__metadata__"]["ddiloco"] = _mutate_json(description, data).decode()
        new_header = json.dumps(header).encode()
    return len(new_header).to_bytes(8, "little") + new_header + original[8 + hlen:]


def _hostile_bytes(original: bytes | None, key: str, data: st.DataObject) -> bytes:
    if original is None or data.draw(st.booleans(), label="random bytes"):
        return data.draw(st.binary(max_size=400), label="bytes")
    if key.endswith(".safetensors"):
        return _mutate_payload(original, data)
    return _mutate_json(original, data)


def _fresh_copy(template_root: str, tmp_root: str) -> str:
    import shutil

    root = os.path.join(tmp_root, f"run-{time.monotonic_ns()}")
    shutil.copytree(template_root, root)
    return root


def _clean(exc: BaseException) -> None:
    """A reader's failure must be ours (DdilocoError) with a one-line message."""
    from ddiloco_cli.errors import DdilocoError

    if not isinstance(exc, DdilocoError):
        raise exc
    assert "\n" not in str(exc).strip() and len(str(exc)) < 2000, str(exc)


def _syncer_commits(store, what: str) -> None:
    """A syncer started on the bucket either refuses with one clean line (when the run's
    own config or plan is what is broken) or commits fragment 1 from the honest learner."""
    try:
        s = Syncer(store, options=SyncerOptions(syncer_id="fuzz", gc=False, poll_s=0.0))
        assert s.acquire(stop=lambda: False)
        s.check_fence()
        s.restore()
    except Exception as exc:  # noqa: BLE001 - judged by _clean
        _clean(exc)
        assert what in ("run", "plan"), f"the syncer stopped over the {what}: {exc}"
        return
    if 1 not in s.states:
        assert what in ("run", "plan"), what
        return
    v1 = s.states[1].version
    contribution(store, 1, HONEST, 10**15 + 7, base_version=v1)
    s._refresh_learners()
    s.poll_contributions()
    if what in ("run", "plan"):  # a valid but changed config (say, a larger quorum) may rightly not merge
        s.maybe_merge(s.states[1])
        return
    deadline = time.monotonic() + 60  # a live hostile learner only adds the (short) grace window
    while not s.maybe_merge(s.states[1]):
        assert time.monotonic() < deadline, f"fragment 1 did not commit with a hostile {what}"
        time.sleep(0.01)


def _observers_and_export(store, tmp_root: str) -> None:
    from ddiloco_cli.ops.export import export_model
    from ddiloco_cli.ops.observe import inspect_run, run_status, verify_run

    for reader in (lambda: run_status(store), lambda: inspect_run(store), lambda: verify_run(store),
                   lambda: export_model(store, os.path.join(tmp_root, "model.safetensors"))):
        try:
            reader()
        except Exception as exc:  # noqa: BLE001 - judged by _clean
            _clean(exc)


FUZZ_TARGETS = ["run", "plan", "latest manifest", "older manifest", "latest delta", "keyframe", "latest hint",
                "checkpoint", "pending contribution", "honest contribution", "epoch", "next epoch",
                "syncer heartbeat", "learner heartbeat", "quarantine report"]


@pytest.mark.parametrize("what", FUZZ_TARGETS)
@settings(max_examples=int(os.environ.get("DDILOCO_FUZZ_EXAMPLES", "6")), deadline=None,
          derandomize=not os.environ.get("DDILOCO_FUZZ_EXAMPLES"),
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_every_reader_survives_hostile_objects_R7(template, tmp_path, what, data):
    """[R7][V1] random bytes or a mutated valid object at ``what``: the syncer commits the
    other fragment (or, for run.json/plan.json, refuses in one line), and status, inspect,
    inspect --verify and export return or fail with one clean line."""
    template_root, keys = template
    key = keys[what]
    store = open_store(_fresh_copy(template_root, str(tmp_path)))
    try:
        original = store.get(key)
    except KeyError:
        original = None
    store.put(key, _hostile_bytes(original, key, data))
    _syncer_commits(store, what)
    _observers_and_export(store, str(tmp_path))


@pytest.mark.parametrize("what,body,fatal", [
    ("run", nested(DEEP).encode(), True),
    ("latest delta", b"\x00" * 64, True),
    ("learner heartbeat", ('{"tokens":' + "9" * 5000 + "}").encode(), False),
])
def test_learn_and_export_exit_cleanly_R7(template, tmp_path, monkeypatch, capsys, what, body, fatal):
    """[R7] through the CLI's entry point: `learn` and `export` either work or exit with one
    error line naming the bad object; never a traceback."""
    template_root, keys = template
    root = _fresh_copy(template_root, str(tmp_path))
    open_store(root).put(keys[what], body)
    for command in (["learn", root, "--learner-id", "bob", "--steps", "2", "--threads", "1"],
                    ["export", root, str(tmp_path / "model.safetensors")]):
        code, out = run_cli(monkeypatch, capsys, *command)
        if fatal:
            assert code != 0 and one_error(out, naming=keys[what]), (command, out)
        else:
            assert code == 0 and "Traceback" not in out, (command, out)
