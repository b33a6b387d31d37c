"""`ddiloco export`: the latest published fragments, reassembled, load strictly into the task model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from ddiloco_cli.ops.export import assemble_parameters, export_model, exported_metadata, load_exported
from ddiloco_cli.protocol import ledger
from ddiloco_cli.protocol.fragments import gather_fragment, plan_fragments
from ddiloco_cli.tasks import load_task

from support.built_run import build_run, invoke, latest_values


def test_assemble_parameters_inverts_gather_with_row_splits():
    params = {"a": torch.randn(10, 3), "b": torch.randn(7), "c": torch.randn(()), "d": torch.randn(4, 2, 2)}
    plan = plan_fragments({k: (tuple(v.shape), "float32") for k, v in params.items()}, 4)
    assert any(not s.is_whole for f in plan.fragments for s in f), "the plan should split a tensor by rows"
    values = {p: gather_fragment(plan, p, params) for p in range(plan.num_fragments)}
    out = assemble_parameters(plan, values)
    assert set(out) == set(params)
    for k in params:
        assert torch.equal(out[k], params[k]), k


def test_export_round_trips_into_the_model(tmp_path):
    # P=8 cuts the tiny GPT's largest matrices by rows, so reassembly is exercised
    built = build_run(str(tmp_path / "run"), rounds=2, num_fragments=8, sync_every=8)
    assert any(not s.is_whole for f in built.plan.fragments for s in f)
    out = str(tmp_path / "out" / "model.safetensors")
    result = invoke("export", built.url, out)
    assert result.exit_code == 0, result.output

    meta = exported_metadata(out)
    assert meta["run"]["run_id"] == built.run["run_id"]
    assert meta["versions"] == {p: 2 for p in range(8)}

    model = load_task(built.run["task"]).build_model()
    state = load_file(out)
    model.load_state_dict(state, strict=True)
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])  # tied alias present

    # every parameter equals the latest published value, slice by slice
    params = dict(model.named_parameters())
    for p, value in latest_values(built).items():
        got = gather_fragment(built.plan, p, params)
        for key, v in value.items():
            assert torch.equal(got[key], v), key
    # and it is not simply the initial model
    fresh = dict(load_task(built.run["task"]).build_model().named_parameters())
    assert not torch.equal(fresh["transformer.h.0.mlp.c_fc.weight"], params["transformer.h.0.mlp.c_fc.weight"])

    loaded = load_exported(out)
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, state[name]), name


def test_export_info(tmp_path):
    built = build_run(str(tmp_path / "run"), rounds=1)
    info = export_model(built.store, str(tmp_path / "m.safetensors"))
    assert info["run_id"] == built.run["run_id"]
    assert info["versions"] == {0: 1, 1: 1}
    assert info["num_params"] == sum(p.numel() for p in load_exported(str(tmp_path / "m.safetensors")).parameters())
    assert json.loads(json.dumps(info))  # serialisable for the CLI
    assert ledger.latest_version(built.store, 0) == 1


def test_export_refuses_a_directory_or_an_impossible_parent_before_reading(tmp_path):
    from ddiloco_cli.errors import UsageError
    from ddiloco_cli.store import open_store

    store = open_store(str(tmp_path / "no-run-here"))  # a bad OUT is reported before any bucket read
    with pytest.raises(UsageError, match="is a directory; give a file name"):
        export_model(store, str(tmp_path))
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="is a file, not a directory"):
        export_model(store, str(tmp_path / "file" / "model.safetensors"))


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_export_honours_the_umask(tmp_path, umask):
    import os
    import stat

    built = build_run(str(tmp_path / "run"), rounds=1)
    old = os.umask(umask)
    try:
        export_model(built.store, str(tmp_path / "m.safetensors"))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "m.safetensors").stat().st_mode) == 0o666 & ~umask
