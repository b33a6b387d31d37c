"""What the benchmarks (scripts/bench_*.py) and the multi-process tests share.

``Launcher`` is the one way they start processes: ``python -m ddiloco_cli ...``
(or any command) with its output in a log file, SIGKILLed at ``close()``;
tests/support/procs.py is this class. ``start_moto`` runs a moto S3 server on a free port.
``StackTask`` (``--task /abs/path/scripts/benchlib.py:stack``) is the tiny task of
the benchmarks that need a model of a chosen size but no real data.

A ``Cluster`` runs real ``python -m ddiloco_cli`` processes (init, one syncer, M
learners) against a local-directory bucket, with logs in a work directory; it
can SIGKILL and restart learners, waits on learner heartbeats, and reads back
heartbeats, fragment versions and the manifest ledger. Around it sit the pieces
with logic of their own, kept pure so tests/unit/test_benchlib.py can check them:
the seeded failure trace, goodput arithmetic, the longest stall in a series of
version samples, and the plain data-parallel AdamW baseline.

``paced_tiny`` is a task for ``--task /abs/path/scripts/benchlib.py:paced_tiny``:
the built-in tiny GPT whose every training loss call also sleeps
$DDILOCO_BENCH_PACE_MS milliseconds. It stands in for an accelerator: a learner's
step time is then mostly wall clock, not CPU, so several learners share the two
CPU cores without one learner's death speeding the others up.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from ddiloco_cli.learner import lr_at
from ddiloco_cli.protocol import layout, ledger
from ddiloco_cli.protocol.published import load_global_model
from ddiloco_cli.store import open_store
from ddiloco_cli.tasks import evaluate
from ddiloco_cli.tasks.gpt import GPTConfig, GPTTask
from ddiloco_cli.tasks.gpt import tiny as _tiny

BENCHLIB_PATH = os.path.abspath(__file__)
PACED_TASK = f"{BENCHLIB_PATH}:paced_tiny"
PACE_ENV = "DDILOCO_BENCH_PACE_MS"
STEP_ENV = "DDILOCO_BENCH_STEP_MS"  # a fixed step time: each training loss() waits for the previous + this


# --------------------------------------------------------------------------- paced task


class PacedTask:
    """Wraps a task; in training mode each loss() call first sleeps pace_ms (read
    from $DDILOCO_BENCH_PACE_MS at call time, default 0), or, with $DDILOCO_BENCH_STEP_MS,
    until that many ms after the previous training call began (a fixed step time, whatever
    the host's speed, while a step's own work takes less). Evaluation (model.eval())
    is not paced. Everything else is delegated, so the model and data are the
    wrapped task's."""

    def __init__(self, inner: Any):
        self.inner = inner
        self._due = None  # monotonic time the next paced training step may begin

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def build_model(self):
        return self.inner.build_model()

    def batches(self, *, shard: int, num_shards: int, seed: int, batch_size: int):
        return self.inner.batches(shard=shard, num_shards=num_shards, seed=seed, batch_size=batch_size)

    def val_batches(self, *, batch_size: int):
        return self.inner.val_batches(batch_size=batch_size)

    def num_tokens(self, batch: Any) -> int:
        return self.inner.num_tokens(batch)

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        pace_ms = float(os.environ.get(PACE_ENV, "0") or 0)
        step_ms = float(os.environ.get(STEP_ENV, "0") or 0)
        if step_ms > 0 and model.training:
            now = time.monotonic()
            if self._due is not None and self._due > now:
                time.sleep(self._due - now)  # the rest of the fixed step time
            self._due = max(now, self._due or now) + step_ms / 1e3
        elif pace_ms > 0 and model.training:
            time.sleep(pace_ms / 1e3)
        return self.inner.loss(model, batch)


if os.path.dirname(BENCHLIB_PATH) not in sys.path:  # loaded by path, as a run's task module
    sys.path.insert(0, os.path.dirname(BENCHLIB_PATH))
from benchtasks import big, mid  # noqa: E402,F401 - the benchmarks' GPTs (benchlib.mid, benchlib.big)

paced_tiny = PacedTask(_tiny)
paced_mid = PacedTask(mid)
# name -> (task path for `ddiloco init --task`, the unpaced task)
PACED_TASKS = {"tiny": (PACED_TASK, _tiny), "mid": (f"{BENCHLIB_PATH}:paced_mid", mid)}


class LinearStack(torch.nn.Module):
    """Square bias-free Linear layers with tanh: every tensor is a plain matrix, so every
    tensor goes through RDA (the syncer's expensive path) and fragments are equal."""

    def __init__(self, width: int, layers: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


STACK_WIDTH_ENV = "DDILOCO_BENCH_STACK_WIDTH"
STACK_LAYERS_ENV = "DDILOCO_BENCH_STACK_LAYERS"
STACK_TASK = f"{BENCHLIB_PATH}:stack"


class StackTask:
    """A ``LinearStack`` of $DDILOCO_BENCH_STACK_LAYERS layers (default 4) of width
    $DDILOCO_BENCH_STACK_WIDTH (default 1024), read when the model is built, so that a
    benchmark sets the size for itself and for the processes it starts; random inputs,
    loss = mean square of the output, one token per row."""

    @staticmethod
    def _width() -> int:
        return int(os.environ.get(STACK_WIDTH_ENV, "1024"))

    def build_model(self) -> torch.nn.Module:
        return LinearStack(self._width(), int(os.environ.get(STACK_LAYERS_ENV, "4")))

    def batches(self, *, shard: int, num_shards: int, seed: int, batch_size: int):
        g = torch.Generator().manual_seed(seed * 1000 + shard)
        width = self._width()
        while True:
            yield torch.randn(batch_size, width, generator=g)

    def loss(self, model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return model(batch).pow(2).mean()

    def num_tokens(self, batch: torch.Tensor) -> int:
        return int(batch.shape[0])


stack = StackTask()


def slow_env(step_s: float, slowdown: float) -> dict[str, str]:
    """The environment that makes a PACED_TASK learner ``slowdown`` times slower than an
    unpaced one whose steps take ``step_s`` seconds (it sleeps the difference per step)."""
    return {PACE_ENV: f"{1e3 * (slowdown - 1) * step_s:.1f}"}


# --------------------------------------------------------------------------- processes


class Launcher:
    """Starts processes with stdout and stderr appended to ``log_dir/NAME.log``; ``close()``
    SIGKILLs whatever still runs. Children get ``env`` (default: this process's
    environment) with one thread for OpenMP and unbuffered Python output, so their logs
    are current and several share a small machine."""

    def __init__(self, log_dir: str | os.PathLike, *, env: dict[str, str] | None = None, cwd: str | None = None):
        self.log_dir = str(log_dir)
        self.env = {**(os.environ if env is None else env), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.cwd = cwd
        self.procs: list[subprocess.Popen] = []

    def spawn(self, name: str, argv: list[str], *, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start ``argv``; ``env`` adds variables for this process alone. ``proc.name`` is ``name``."""
        with open(os.path.join(self.log_dir, f"{name}.log"), "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**self.env, **(env or {})},
                                    cwd=self.cwd)
        proc.name = name  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def start(self, name: str, *args: str, env: dict[str, str] | None = None,
              prefix: tuple[str, ...] = ()) -> subprocess.Popen:
        """Start ``python -m ddiloco_cli ARGS``, after ``prefix`` (e.g. nice, taskset)."""
        return self.spawn(name, [*prefix, sys.executable, "-m", "ddiloco_cli", *args], env=env)

    def run(self, *args: str, timeout_s: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run ``python -m ddiloco_cli ARGS`` to its end; output captured as text."""
        return subprocess.run([sys.executable, "-m", "ddiloco_cli", *args], env={**self.env, **(env or {})},
                              cwd=self.cwd, capture_output=True, text=True, timeout=timeout_s)

    def log(self, name: str) -> str:
        """The log of process ``name`` so far ("" before it has one)."""
        try:
            with open(os.path.join(self.log_dir, f"{name}.log"), errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def signed_run(store: Any, keys: dict[str, Any], *, task: str, lease_s: float) -> dict[str, Any]:
    """A run that requires signatures (admin key ``keys["admin"]``), learner ``a`` admitted
    (``keys["a"]``) with a signed, live heartbeat, syncer ``s`` admitted (``keys["syncer"]``);
    returns run.json's record (bench_junk.py and the tests' signed runs)."""
    from ddiloco_cli.ops.runinit import RunSpec, init_run
    from ddiloco_cli.protocol import records, signing

    run = init_run(store, RunSpec(task=task, num_fragments=2, sync_every=4, codec="none", publish_codec="none",
                                  lease_s=lease_s, heartbeat_s=1.0, outer_lr=0.7), admin=keys["admin"])
    signing.admit(store, run=run, member_id="a", public_key=keys["a"].public_key, role="learner", admin=keys["admin"])
    signing.admit(store, run=run, member_id="s", public_key=keys["syncer"].public_key, role="syncer",
                  admin=keys["admin"])
    rec = records.make("learner_heartbeat", run_id=run["run_id"], learner_id="a", state="running", step=1, tokens=1,
                       step_time_s=0.01)
    hb = layout.learner_heartbeat_key("a")
    store.put(hb, records.dumps(signing.sign_record(rec, run_id=run["run_id"], key=hb, signer=keys["a"])))
    return run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pinned(cpu: int | None) -> list[str]:
    """The ``taskset`` prefix that runs a command on CPU ``cpu`` (nothing: None, one CPU, or no taskset)."""
    if cpu is None or (os.cpu_count() or 1) < 2 or shutil.which("taskset") is None:
        return []
    return ["taskset", "-c", str(cpu)]


def start_moto(launcher: Launcher, *, bucket: str, timeout_s: float = 30, cpu: int | None = None) -> str:
    """Start moto's S3 server (its stock ``moto_server``) on a free port as process "moto"
    of ``launcher`` (on CPU ``cpu``: it stands for the service, whose CPU is not the client's),
    wait until it serves, create ``bucket``; returns the endpoint URL."""
    import boto3

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = launcher.spawn("moto", [*pinned(cpu), str(Path(sys.executable).with_name("moto_server")), "-H",
                                   "127.0.0.1", "-p", str(port)])
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                         region_name="us-east-1").create_bucket(Bucket=bucket)
            return endpoint
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError(f"moto_server did not start; see {launcher.log_dir}/moto.log") from None
            time.sleep(0.3)


def moto_for_this_process(workdir: str, *, bucket: str, cpu: int | None = 1) -> Launcher:
    """A moto S3 server (on CPU ``cpu``) holding ``bucket``, and this process's environment set to
    reach it (``AWS_ENDPOINT_URL``, test credentials, us-east-1: child processes inherit them).
    Returns its launcher: ``close()`` it when done."""
    log_dir = os.path.join(workdir, "moto")
    os.makedirs(log_dir, exist_ok=True)
    launcher = Launcher(log_dir)
    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    os.environ["AWS_ENDPOINT_URL"] = start_moto(launcher, bucket=bucket, cpu=cpu, timeout_s=60)
    return launcher


def init_args(url: str, **flags: Any) -> list[str]:
    """The command line `ddiloco init URL --flag value ...` for ``flags`` (underscores become
    dashes; True is a bare flag, False its --no- form, None leaves it out)."""
    args = ["init", url]
    for k, v in flags.items():
        name = k.replace("_", "-")
        if v is True:
            args.append("--" + name)
        elif v is False:
            args.append("--no-" + name)
        elif v is not None:
            args += ["--" + name, str(v)]
    return args


class Cluster:
    """Processes of one run on a local-directory bucket at ``workdir/bucket``;
    logs in ``workdir/logs``. ``close()`` SIGKILLs whatever is still running."""

    def __init__(self, workdir: str, *, env: dict[str, str] | None = None, fresh: bool = True):
        self.workdir = os.path.abspath(workdir)
        if fresh and os.path.exists(self.workdir):
            shutil.rmtree(self.workdir)
        self.bucket = os.path.join(self.workdir, "bucket")
        self.log_dir = os.path.join(self.workdir, "logs")
        os.makedirs(self.bucket, exist_ok=True)
        os.makedirs(self.log_dir, exist_ok=True)
        self.url = self.bucket
        self.launcher = Launcher(self.log_dir, env={**os.environ, **(env or {})})
        self.env = self.launcher.env
        self.syncer: subprocess.Popen | None = None
        self.learners: dict[str, subprocess.Popen] = {}
        self.learner_args: dict[str, list[str]] = {}
        self.spawned_s: dict[str, float] = {}  # learner id -> wall time of its latest spawn
        self._store = None

    @property
    def store(self):
        if self._store is None:
            self._store = open_store(self.url)
        return self._store

    def init(self, **flags: Any) -> dict[str, Any]:
        """`ddiloco init BUCKET --flag value ...` (underscores become dashes; True is a bare
        flag, False its --no- form, None leaves it out). Returns run.json. Raises RuntimeError
        with the output if init fails."""
        out = self.launcher.run(*init_args(self.url, **flags), timeout_s=300)
        if out.returncode != 0:
            raise RuntimeError(f"ddiloco init failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
        self.run = ledger.read_run(self.store)
        return self.run

    def start_syncer(self, *extra: str) -> subprocess.Popen:
        self.syncer = self.launcher.start("syncer", "sync", self.url, "--no-gc", *extra)
        return self.syncer

    def start_learner(self, learner_id: str, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start (or, with the same id, restart: it resumes its step count) a learner;
        ``env`` adds variables for it alone (e.g. PACE_ENV)."""
        if extra or learner_id not in self.learner_args:
            # the task from our own command line: a learner never imports a file path named by run.json
            self.learner_args[learner_id] = ["learn", self.url, "--learner-id", learner_id, "--threads", "1",
                                             "--task", self.run["task"], *extra]
        self.spawned_s[learner_id] = time.time()
        proc = self.launcher.start(f"learner-{learner_id}", *self.learner_args[learner_id], env=env)
        self.learners[learner_id] = proc
        return proc

    def kill_learner(self, learner_id: str) -> bool:
        """SIGKILL a learner; False if it was not running."""
        proc = self.learners.get(learner_id)
        if proc is None or proc.poll() is not None:
            return False
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return True

    def learner_running(self, learner_id: str) -> bool:
        proc = self.learners.get(learner_id)
        return proc is not None and proc.poll() is None

    def stop_syncer(self, *, timeout_s: float = 30) -> int | None:
        if self.syncer is None or self.syncer.poll() is not None:
            return None if self.syncer is None else self.syncer.returncode
        self.syncer.send_signal(signal.SIGTERM)
        try:
            return self.syncer.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.syncer.kill()
            return self.syncer.wait()

    def terminate_learners(self, *, timeout_s: float = 60) -> None:
        """SIGTERM every running learner (they finish the step and uploads in flight) and wait."""
        live = [p for p in self.learners.values() if p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)
        for p in live:
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def close(self) -> None:
        self.launcher.close()

    def log_tail(self, name: str, n_chars: int = 3000) -> str:
        return self.launcher.log(name)[-n_chars:]

    # ----------------------------------------------------------------- reading the bucket
    def heartbeats(self) -> dict[str, dict[str, Any]]:
        """learner id -> its latest heartbeat record (store-clock age added as age_s)."""
        beats = ledger.read_heartbeats(self.store, layout.LEARNER_HEARTBEAT_PREFIX, "learner_heartbeat")
        return {b.record["learner_id"]: {**b.record, "age_s": b.age_s} for b in beats}

    def versions(self) -> list[int]:
        """Latest committed version of every fragment (LIST per fragment: the truth, not the hint)."""
        return [ledger.latest_version(self.store, p) or 0 for p in range(int(self.run["num_fragments"]))]

    def manifests(self) -> list[dict[str, Any]]:
        """Every committed manifest (all fragments, all versions); needs the syncer's --no-gc."""
        out = []
        for p in range(int(self.run["num_fragments"])):
            for v in ledger.list_versions(self.store, p):
                out.append(ledger.read_manifest(self.store, p, v, run_id=self.run["run_id"]))
        return out

    def unmerged_contributions(self) -> int:
        """Contributions in the bucket above the latest manifest's high-water mark of their
        learner: uploaded but neither merged nor superseded yet."""
        n = 0
        for p in range(int(self.run["num_fragments"])):
            latest = ledger.latest_version(self.store, p)
            high = ledger.read_manifest(self.store, p, latest, run_id=self.run["run_id"])["high_water"] if latest else {}
            for info in self.store.list(layout.contribution_prefix(p)):
                parsed = layout.parse_contribution_key(info.key)
                if parsed is not None and parsed[2] > high.get(parsed[1], -1):
                    n += 1
        return n

    def learners_up(self, heartbeats: dict[str, dict[str, Any]] | None = None) -> list[str]:
        """Learners whose process runs and whose current session is training: a heartbeat
        in state running started after the latest spawn of that learner."""
        beats = self.heartbeats() if heartbeats is None else heartbeats
        up = []
        for lid, proc in self.learners.items():
            hb = beats.get(lid)
            if proc.poll() is None and hb is not None and hb["state"] == "running" \
                    and float(hb["started_s"]) >= self.spawned_s[lid] - 1.0:
                up.append(lid)
        return up

    def wait_learners_finished(self, learner_ids: Iterable[str], *, timeout_s: float,
                               on_tick=None, poll_s: float = 0.5) -> None:
        """Wait until every learner's process has exited with code 0 and its heartbeat says
        finished. on_tick(cluster) is called every poll (the chaos driver runs there).
        Raises RuntimeError with log tails on timeout or on a nonzero exit."""
        ids = list(learner_ids)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if on_tick is not None:
                on_tick(self)
            done = True
            for lid in ids:
                proc = self.learners[lid]
                rc = proc.poll()
                if rc is None:
                    done = False
                elif rc not in (0, -signal.SIGKILL):
                    raise RuntimeError(f"learner {lid} exited with {rc}:\n{self.log_tail('learner-' + lid)}")
                elif rc == -signal.SIGKILL:
                    done = False  # killed by the chaos driver; it restarts it
            if done:
                beats = self.heartbeats()
                if all(beats.get(lid, {}).get("state") == "finished" for lid in ids):
                    return
            time.sleep(poll_s)
        tails = "".join(f"\n--- {n} ---\n{self.log_tail(n)}" for n in ["syncer", *(f"learner-{i}" for i in ids)])
        raise RuntimeError(f"learners not finished after {timeout_s}s{tails}")

    def drain(self, *, timeout_s: float = 30, poll_s: float = 0.25) -> int:
        """Wait (up to timeout_s) until the syncer has merged or superseded every uploaded
        contribution; returns how many were still unmerged at the end (0: drained)."""
        deadline = time.monotonic() + timeout_s
        while True:
            n = self.unmerged_contributions()
            if n == 0 or time.monotonic() > deadline:
                return n
            time.sleep(poll_s)

    def global_model(self, task: Any) -> tuple[torch.nn.Module, dict[int, int]]:
        """The task's model holding the latest global parameters; and their versions."""
        plan = ledger.read_plan(self.store, run_id=self.run["run_id"])
        model = task.build_model()
        versions = load_global_model(self.store, run_id=self.run["run_id"], plan=plan, model=model)
        return model, versions


def merged_tokens(manifests: Iterable[dict[str, Any]], *, num_fragments: int,
                  window_s: tuple[float, float] | None = None) -> float:
    """Tokens that reached the global model, averaged over fragments: the sum of
    c_tokens of the used contributions of every manifest (optionally only those
    created within window_s = (start, end), wall-clock seconds), divided by the
    number of fragments. A superseded contribution's progress is carried by its
    successor's c_tokens, so it is not counted twice."""
    total = 0
    for m in manifests:
        if window_s is not None and not window_s[0] <= float(m["created_s"]) < window_s[1]:
            continue
        total += sum(int(c.get("merged_tokens", c["c_tokens"])) for c in m["contributions"] if c.get("used"))
    return total / num_fragments


# --------------------------------------------------------------------------- evaluation


def measure_step_s(task: Any, *, batch_size: int, steps: int = 5) -> float:
    """Seconds per AdamW training step of ``task`` in this process (after one warm-up step)."""
    model = task.build_model()
    opt = torch.optim.AdamW(model.parameters())
    batches = task.batches(shard=0, num_shards=1, seed=0, batch_size=batch_size)
    t0 = 0.0
    for i in range(steps + 1):
        if i == 1:
            t0 = time.perf_counter()
        loss = task.loss(model, next(batches))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return (time.perf_counter() - t0) / steps


def val_loss(task: Any, model: torch.nn.Module, *, batch_size: int = 64, max_batches: int | None = None) -> float:
    """Validation loss on the task's fixed val set (the same batches for every arm)."""
    return evaluate(task, model, batch_size=batch_size, max_batches=max_batches)


def train_data_parallel(task: Any, *, steps: int, batch_size: int, inner: dict[str, Any], seed: int = 0,
                        data_seed: int = 12345, log_every: int = 0) -> torch.nn.Module:
    """The data-parallel equivalent: one process, one model, a plain AdamW loop of
    `steps` steps at `batch_size` (M times a learner's batch), with a learner's inner
    optimizer and schedule (inner: run.json's "inner": lr, betas, weight_decay,
    warmup_steps, lr_schedule, total_steps, grad_clip). Data: random windows of the
    whole training set (shard 0 of 1), like a learner without --shard."""
    torch.manual_seed(seed)
    model = task.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=float(inner["lr"]), betas=tuple(inner["betas"]),
                            weight_decay=float(inner["weight_decay"]))
    batches = task.batches(shard=0, num_shards=1, seed=data_seed, batch_size=batch_size)
    model.train()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, inner)
        loss = task.loss(model, next(batches))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if float(inner["grad_clip"]) > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), float(inner["grad_clip"]))
        opt.step()
        if log_every and (step + 1) % log_every == 0:
            print(f"  dp step {step + 1} loss {loss.item():.4f}", file=sys.stderr)
    return model


# --------------------------------------------------------------------------- failure traces


@dataclass(frozen=True)
class Failure:
    t_s: float  # seconds after the trace's start: SIGKILL
    learner: str
    restart_delay_s: float  # the same command is started again this long after the kill


def failure_trace(*, seed: int, learner_ids: list[str], mean_between_s: float, restart_delay_s: float,
                  duration_s: float) -> list[Failure]:
    """Failures of each learner, sorted by time: per learner, times between failures are
    exponential with mean mean_between_s, counted from the moment it is back (so a
    learner is never killed while it is down); only failures before duration_s are
    kept. The same arguments always give the same trace (random.Random(seed),
    learners drawn in the given order)."""
    if mean_between_s <= 0 or restart_delay_s < 0 or duration_s < 0:
        raise ValueError("mean_between_s must be > 0, restart_delay_s and duration_s >= 0")
    rng = random.Random(seed)
    out: list[Failure] = []
    for lid in learner_ids:
        t = 0.0
        while True:
            t += rng.expovariate(1.0 / mean_between_s)
            if t >= duration_s:
                break
            out.append(Failure(round(t, 3), lid, restart_delay_s))
            t += restart_delay_s
    out.sort(key=lambda f: (f.t_s, f.learner))
    return out


class ChaosDriver:
    """Replays a failure trace on a Cluster: call tick(cluster) often (e.g. as
    wait_learners_finished's on_tick). A failure kills the learner only if it is
    running and not finished; its restart fires restart_delay_s later unless the
    learner had already finished. Records (t, event, learner) in `events`."""

    def __init__(self, trace: list[Failure], *, t0: float | None = None):
        self.trace = list(trace)
        self.t0 = time.monotonic() if t0 is None else t0
        self.restarts: list[tuple[float, str]] = []  # (due time, learner)
        self.events: list[tuple[float, str, str]] = []
        self.skipped = 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def tick(self, cluster: Cluster) -> None:
        now = self.now()
        while self.trace and self.trace[0].t_s <= now:
            f = self.trace.pop(0)
            if cluster.learner_running(f.learner) and cluster.kill_learner(f.learner):
                self.events.append((round(now, 2), "kill", f.learner))
                self.restarts.append((f.t_s + f.restart_delay_s, f.learner))
            else:
                self.skipped += 1
        for due, lid in sorted(self.restarts):
            if due <= now:
                self.restarts.remove((due, lid))
                cluster.start_learner(lid)
                self.events.append((round(now, 2), "restart", lid))

    def pending_restarts(self) -> int:
        return len(self.restarts)


# --------------------------------------------------------------------------- goodput and stalls


def goodput(*, useful_tokens: float, elapsed_s: float, fault_free_tokens_per_s: float) -> float:
    """Useful tokens per second over the fault-free rate (1.0 = no loss)."""
    if elapsed_s <= 0 or fault_free_tokens_per_s <= 0:
        raise ValueError("elapsed_s and fault_free_tokens_per_s must be > 0")
    return useful_tokens / elapsed_s / fault_free_tokens_per_s


@dataclass(frozen=True)
class Sample:
    t_s: float
    versions: tuple[int, ...]
    learners_up: int
    syncer_up: bool


def longest_stall(samples: list[Sample]) -> float:
    """Longest time with at least one learner up and a syncer up during which no
    fragment version advanced. An interval is measured from the later of (the last
    advance, the moment the condition became true) to the first sample that shows an
    advance or breaks the condition (or the last sample). Samples must be in time order."""
    worst = 0.0
    start: float | None = None
    prev: Sample | None = None
    for s in samples:
        live = s.learners_up > 0 and s.syncer_up
        advanced = prev is not None and s.versions != prev.versions
        if start is not None:
            worst = max(worst, s.t_s - start)
            if advanced or not live:
                start = None
        if live and start is None:
            start = s.t_s
        prev = s
    return worst


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so `finally: cluster.close()` kills the children."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def load_text() -> str:
    """`uptime`'s load averages, for printing next to timings."""
    try:
        return "load %.2f %.2f %.2f" % os.getloadavg()
    except OSError:
        return "load n/a"


def fmt_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A plain fixed-width table."""
    cells = [[str(h) for h in headers]] + [[f"{c:.4g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_result(out: dict, *, json_path: str | None, workdir: str, keep_workdir: bool) -> dict:
    """Write a benchmark's JSON result (if asked) and remove its scratch directory."""
    import json

    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1, default=str)
    if not keep_workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return out
