"""Least privilege (examples/policies/; PROTOCOL.md, "Signatures", [A7]).

moto enforces IAM identity policies on S3 calls once authentication is switched on
(its /moto-api/reset-auth endpoint, the server-mode form of INITIAL_NO_AUTH_ACTION_COUNT).
It does not evaluate bucket policies, NotResource or the `?` wildcard, and no GCS
emulator evaluates IAM conditions; so the identity policy is enforced for real here,
and the bucket policy and the GCS condition are checked to grant the same key
patterns as the identity policy.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request

import pytest

from support import REPO
from support.built_run import invoke
from support.procs import Procs, all_manifests, terminate, wait_for
from support.servers import MOTO_PROC

POLICIES = REPO / "examples" / "policies"
BUCKET, PREFIX = "ddiloco-policy", "run"
ADMIN_POLICY = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}


def _template(name: str, **values: str) -> str:
    text = (POLICIES / name).read_text()
    for k, v in {"BUCKET": BUCKET, "RUN_PREFIX": PREFIX, **values}.items():
        text = text.replace(k, v)
    return text


def _s3_env(endpoint: str, key: dict) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return {**env, "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"], "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def iam_s3():
    """A moto server of our own (authentication is server-wide) with users `admin`
    (everything) and `learner-a` (examples/policies/s3-learner-policy.json for id
    learner-a); authentication is on when this yields {user: env}."""
    import boto3

    proc = subprocess.Popen([sys.executable, str(MOTO_PROC)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        endpoint = proc.stdout.readline().strip()
        assert endpoint.startswith("http://"), "moto server did not start"
        setup = dict(endpoint_url=endpoint, aws_access_key_id="setup", aws_secret_access_key="setup",
                     region_name="us-east-1")
        boto3.client("s3", **setup).create_bucket(Bucket=BUCKET)
        iam = boto3.client("iam", **setup)
        envs = {}
        for user, policy in (("admin", json.dumps(ADMIN_POLICY)),
                             ("learner-a", _template("s3-learner-policy.json", LEARNER_ID="learner-a"))):
            iam.create_user(UserName=user)
            iam.put_user_policy(UserName=user, PolicyName="ddiloco", PolicyDocument=policy)
            envs[user] = _s3_env(endpoint, iam.create_access_key(UserName=user)["AccessKey"])
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=b"0", method="POST",
                                                      headers={"Content-Type": "text/plain"}), timeout=30).read()
        yield envs
    finally:
        proc.kill()
        proc.wait()


def _client(env: dict[str, str]):
    import boto3

    return boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")


@pytest.mark.s3
def test_s3_learner_policy_denies_writes_outside_own_prefixes_A7(iam_s3):
    from botocore.exceptions import ClientError

    s3 = _client(iam_s3["learner-a"])
    allowed = ["contributions/p00003/learner-a/00000000000000000001.safetensors", "learners/learner-a/heartbeat.json",
               "tmp/clock/0123456789abcdef0123456789abcdef", "metrics/learner/learner-a/00000000000000000000-0a1b2c3d.jsonl"]
    denied = ["run.json", "plan.json", "admissions/learner-a.json", "fragments/p00000/manifests/00000000000000000001.json",
              "syncers/epochs/00000000000000000009.json", "quarantine/x.json", "checkpoints/p00000/x.safetensors",
              "contributions/p00000/learner-b/00000000000000000001.safetensors", "learners/learner-b/heartbeat.json",
              "learners/learner-ab/heartbeat.json", "metrics/learner/learner-b/00000000000000000000-0a1b2c3d.jsonl",
              "metrics/syncer/fragments-all/00000000000000000000-0a1b2c3d.jsonl"]
    for key in allowed:
        s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{key}", Body=b"{}")
    for key in denied:
        with pytest.raises(ClientError, match="AccessDenied"):
            s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{key}", Body=b"{}")
    with pytest.raises(ClientError, match="AccessDenied"):
        s3.delete_object(Bucket=BUCKET, Key=f"{PREFIX}/{allowed[0]}")
    for key in allowed[2:]:
        s3.delete_object(Bucket=BUCKET, Key=f"{PREFIX}/{key}")
    assert s3.get_object(Bucket=BUCKET, Key=f"{PREFIX}/{allowed[1]}")["Body"].read() == b"{}"
    for key in allowed[:2]:  # the run below uses this prefix
        _client(iam_s3["admin"]).delete_object(Bucket=BUCKET, Key=f"{PREFIX}/{key}")


def test_bucket_policy_and_gcs_condition_grant_what_the_identity_policy_grants_A7():
    """The three files must not drift apart: same writable key patterns in each."""
    identity = json.loads(_template("s3-learner-policy.json", LEARNER_ID="L"))
    puts = next(s["Resource"] for s in identity["Statement"] if s["Action"] == "s3:PutObject")
    deletes = next(s["Resource"] for s in identity["Statement"] if s["Action"] == "s3:DeleteObject")
    bucket = json.loads(_template("s3-bucket-policy.json", LEARNER_ID="L"))
    denies = {s.get("Action"): s.get("NotResource") for s in bucket["Statement"]}
    assert sorted(denies["s3:PutObject"]) == sorted(puts) and denies["s3:DeleteObject"] == deletes
    gcs = json.loads(_template("gcs-learner-iam.json", LEARNER_ID="L"))
    create = next(b["condition"]["expression"] for b in gcs["bindings"] if b["role"] == "roles/storage.objectCreator")
    gcs_patterns = sorted(re.sub(r"\{\w+\}", "*", p) + "*" for p in re.findall(r'"projects/_/buckets/([^"]+)"', create))
    s3_patterns = sorted(r.removeprefix("arn:aws:s3:::") for r in puts)
    assert [p.replace("/objects/", "/", 1) for p in gcs_patterns] == s3_patterns


@pytest.mark.s3
@pytest.mark.slow
def test_learner_under_the_policy_needs_no_other_write_A7(iam_s3, tmp_path, monkeypatch):
    """A real learner whose credentials carry only the example policy trains in a signed
    run (the default on s3://), and its contributions are merged by a syncer with full rights."""
    for k, v in iam_s3["admin"].items():  # this process reads the bucket as the admin
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    url = f"s3://{BUCKET}/{PREFIX}"  # the prefix the policy names
    admin = Procs(tmp_path, env=iam_s3["admin"])
    learner = Procs(tmp_path, env=iam_s3["learner-a"])
    try:
        # an s3:// run requires signatures by default: the admin admits the learner's and the syncer's keys
        # (the admin's commands in this process, under the admin's credentials set above: no process starts
        # for them; the syncer and the learner below are real processes)
        r = invoke("init", url, "--task", "ddiloco_cli.tasks.gpt:tiny", "-P", "2", "-H", "4", "--overlap-steps", "1",
                   "--total-steps", "0", "--batch-size", "4", "--lease", "4", "--heartbeat", "1",
                   "--admin-key", str(tmp_path / "admin.pem"))
        assert r.exit_code == 0, r.output
        for name, role in (("learner-a", "learner"), ("syncer-1", "syncer")):
            pub = invoke("keys", "new", str(tmp_path / f"{name}.pem")).stdout.strip().splitlines()[-1]
            r = invoke("admit", url, name, pub, "--role", role, "--admin-key", str(tmp_path / "admin.pem"))
            assert r.exit_code == 0, r.output
        admin.start("syncer", "sync", url, "--poll", "0.2", "--no-gc", "--key", str(tmp_path / "syncer-1.pem"))
        proc = learner.start("learner-a", "learn", url, "--learner-id", "learner-a", "--steps", "12", "--threads", "1",
                             "--key", str(tmp_path / "learner-a.pem"))
        wait_for(lambda: proc.poll() is not None, timeout_s=240, what="the learner to finish", procs=learner)
        log = learner.log("learner-a")
        assert proc.returncode == 0, log[-3000:]
        # the session's summary line counts refusals ("0 refused"): only a refusal of its own counts
        assert not re.search(r"AccessDenied|(?<!\b0 )refused|retry|failed", log), log[-3000:]
        wait_for(lambda: any(c["learner_id"] == "learner-a" and c["used"]
                             for ms in all_manifests(url).values() for m in ms for c in m["contributions"]),
                 timeout_s=120, what="a merge of learner-a's contribution", procs=admin)
    finally:
        for p in admin.procs:
            if p.poll() is None:
                terminate(p)
        admin.close()
        learner.close()
