"""The messages that tell a user what to do next say the right thing (issue 26 item 6):
no `None` in a hint, a public key named as such, the admin key's origin, the task
(not a --model flag that does not exist) and `--wait-for-run`."""

from __future__ import annotations

import uuid

import pytest
import torch

from ddiloco_cli.errors import UsageError
from ddiloco_cli.protocol import ledger, signing
from ddiloco_cli.protocol.fragments import plan_fragments
from ddiloco_cli.store import open_store


@pytest.fixture
def signed(tmp_path):
    store = open_store(f"memory://{uuid.uuid4().hex}")
    admin = signing.new_key(tmp_path / "admin.pem")
    run = {"run_id": "r" * 32, "require_signatures": True, "admin_key": admin.public_key}
    return store, run


def test_a_syncer_without_a_key_is_told_the_admit_command_without_none(signed):
    store, run = signed
    with pytest.raises(UsageError) as exc:
        signing.signer_for_run(store, run=run, key_path=None, member_id=None, role="syncer")
    assert "None" not in str(exc.value) and "NAME PUBKEY --role syncer" in str(exc.value)


def test_a_public_key_passed_as_the_key_is_named_before_any_chmod(tmp_path):
    signing.new_key(tmp_path / "a.pem")
    pub = tmp_path / "a.pem.pub"
    pub.chmod(0o644)
    with pytest.raises(UsageError) as exc:
        signing.load_key(pub)
    assert "is a public key; pass the private key file" in str(exc.value) and "chmod" not in str(exc.value)


def test_a_missing_admin_key_does_not_suggest_making_a_new_one(tmp_path):
    with pytest.raises(UsageError) as exc:
        signing.load_admin_key(tmp_path / "missing.pem", create=False)
    assert "keys new" not in str(exc.value) and "the one `ddiloco init` made" in str(exc.value)


def test_a_model_mismatch_names_the_task_not_a_model_flag():
    plan = plan_fragments({"w": ((4, 4), "float32"), "b": ((4,), "float32")}, num_fragments=1)
    with pytest.raises(UsageError) as exc:
        plan.check_model({"w": torch.zeros(4, 5), "b": torch.zeros(4)})
    assert "--model" not in str(exc.value) and "--task" in str(exc.value)


def test_no_run_yet_mentions_wait_for_run(tmp_path):
    with pytest.raises(ledger.RunNotFoundError, match="--wait-for-run"):
        ledger.read_run(open_store(str(tmp_path / "nothing")))
