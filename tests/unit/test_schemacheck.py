"""The compiled schema check (schemacheck) agrees with jsonschema on real and mutated records.

records.validate accepts a record when the compiled check says yes and asks jsonschema
otherwise, so the compiled check must never say yes where jsonschema says no. Every
record of a real run (run, plan, manifests, hints, epochs, heartbeats) and thousands of
seeded mutations of them (a key dropped or added, a value replaced by every JSON type and
by boundary numbers, strings and lists) must get the same verdict from both.
"""

from __future__ import annotations

import json
import os
import random

import pytest

from ddiloco_cli.protocol import records, schemacheck

from support.built_run import build_run

REPLACEMENTS = [None, True, False, 0, 1, -1, 1.0, 1.5, -0.0, 2**53, 2**53 + 1, 2**63, 1e300, "", "x", "a" * 300,
                "Bad Id!", "alice", [], [1], [{}], {}, {"k": 1}, "00", 7.0]


def _real_records(tmp_path) -> list[tuple[str, dict]]:
    built = build_run(str(tmp_path / "run"), rounds=3)
    out = []
    for root, _, files in os.walk(built.url):
        for name in files:
            if not name.endswith(".json"):
                continue
            rec = json.loads(open(os.path.join(root, name), "rb").read())
            kind = rec.get("format", "").removeprefix("ddiloco.")
            if kind in records.RECORD_TYPES:
                out.append((kind, rec))
    out.append(("latest", records.make("latest", fragment=0, version=3)))  # a hint as ddiloco 0.1 wrote it
    return out


def _mutations(rec, rng: random.Random, n: int):
    """Seeded single-point mutations anywhere in the record's tree."""
    paths = []

    def walk(x, path):
        paths.append(path)
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, path + (k,))
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, path + (i,))
    walk(rec, ())
    for _ in range(n):
        mutated = json.loads(json.dumps(rec))
        path = rng.choice(paths)
        parent = mutated
        for p in path[:-1]:
            parent = parent[p]
        op = rng.random()
        if not path:
            yield rng.choice(REPLACEMENTS)
            continue
        key = path[-1]
        if op < 0.15 and isinstance(parent, dict):
            del parent[key]
        elif op < 0.25 and isinstance(parent, dict):
            parent[rng.choice(["extra", "zz_unknown", "version", "learner_id"])] = rng.choice(REPLACEMENTS)
        elif op < 0.35 and isinstance(parent[key], (int, float)) and not isinstance(parent[key], bool):
            parent[key] = parent[key] + rng.choice([-1, 1, -(2**53), 0.5])
        elif op < 0.4 and isinstance(parent[key], list):
            parent[key] = parent[key] * rng.choice([0, 2, 50])
        else:
            parent[key] = rng.choice(REPLACEMENTS)
        yield mutated


def _jsonschema_valid(kind: str, rec) -> bool:
    return next(records._validator(kind).iter_errors(rec), None) is None


def test_every_schema_compiles():
    """No record type falls back to jsonschema alone (a new keyword must be implemented)."""
    for kind in records.RECORD_TYPES:
        schemacheck.compile_schema(records._schema(kind), formats=records._FORMAT_CHECKS)


def test_no_schema_names_a_key_twice():
    """A JSON object with a duplicate key keeps its last value silently: the run.json and the
    heartbeat schemas each had one (a property written twice), caught by reading them with a
    hook that refuses duplicates."""
    import json
    from importlib import resources

    def refuse_duplicates(pairs):
        keys = [k for k, _ in pairs]
        dupes = sorted({k for k in keys if keys.count(k) > 1})
        assert not dupes, f"{kind}: {dupes} twice"
        return dict(pairs)

    for kind in records.RECORD_TYPES:
        text = resources.files("ddiloco_cli").joinpath(f"schemas/{kind}.schema.json").read_text()
        json.loads(text, object_pairs_hook=refuse_duplicates)


def test_compiled_check_agrees_with_jsonschema_on_real_and_mutated_records(tmp_path):
    real = _real_records(tmp_path)
    kinds = {kind for kind, _ in real}
    assert {"run", "plan", "manifest", "latest", "epoch", "learner_heartbeat", "syncer_heartbeat"} <= kinds, kinds
    rng = random.Random(0)
    checked = disagreements = 0
    for kind, rec in real:
        fast = records._fast_check(kind)
        assert fast(rec) and _jsonschema_valid(kind, rec), (kind, rec)
        for mutated in _mutations(rec, rng, 400):
            checked += 1
            if fast(mutated) != _jsonschema_valid(kind, mutated):
                disagreements += 1
                assert False, (kind, mutated)
    assert checked > 5000 and disagreements == 0
    # the mutations did find invalid records, or the comparison would prove nothing
    assert sum(not records._fast_check(k)(m) for k, r in real[:5] for m in _mutations(r, random.Random(1), 50)) > 50


def test_json_equality_is_jsonschemas():
    assert schemacheck.json_equal(1, 1.0) and not schemacheck.json_equal(True, 1)
    assert not schemacheck.json_equal(False, 0) and schemacheck.json_equal([1, {"a": 2.0}], [1.0, {"a": 2}])
    assert not schemacheck.json_equal("1", 1) and not schemacheck.json_equal(None, False)


@pytest.mark.parametrize("schema", [{"anyOf": [{"type": "string"}]}, {"type": "object", "patternProperties": {}},
                                    {"format": "email"}, {"$ref": "https://example.com/s.json"},
                                    {"if": {"type": "string"}, "else": {}}])
def test_an_unknown_keyword_refuses_to_compile(schema):
    with pytest.raises(schemacheck.Unsupported):
        schemacheck.compile_schema(schema, formats=records._FORMAT_CHECKS)


def test_loads_validates_the_same_bytes_once_and_bad_bytes_every_time(monkeypatch):
    calls = []
    real = records.validate
    monkeypatch.setattr(records, "validate", lambda rec, kind, *, where: calls.append(kind) or real(rec, kind, where=where))
    monkeypatch.setattr(records, "_VALIDATED", set())
    good = records.dumps(records.make("learner_state", run_id="r" * 32, learner_id="L0", session=1, data={}))
    first = records.loads(good, "learner_state", where="a")
    first["data"]["x"] = 1  # each call parses afresh: a caller's change does not leak into the next
    second = records.loads(good, "learner_state", where="b")
    assert calls == ["learner_state"] and second["data"] == {}
    bad = good.replace(b'"session":1', b'"session":"one"')
    for _ in range(2):
        with pytest.raises(records.ProtocolError):
            records.loads(bad, "learner_state", where="c")
    assert calls == ["learner_state"] * 3
