"""Crash points by fork: one run per seed, and at every crash point it passes, a forked
copy of the whole process (copy-on-write: the world as it is at that instant) that
crashes there, runs to the end and checks itself (``crash.verify``), while the parent
goes on uncrashed to the next point.

The run is deterministic, so the child at a point is the run that ``crash.run_point``
replays from the start with the crash at that point, without the replay: a point costs
the rest of the run after it, not the whole run. (A test compares the two: ``run_digest``.) A child reports through a pipe and leaves with
``os._exit``: no ``atexit`` handler, no buffered output of the parent runs twice.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ddiloco_cli.protocol import ledger
from ddiloco_cli.simtrain.crash import CrashPlan, Point, verify
from ddiloco_cli.simtrain.scenario import Scenario
from ddiloco_cli.simtrain.world import World

MAX_REPORT = 60_000  # below a pipe's buffer: a child's report never blocks it


def cpu_s() -> float:
    """CPU time of this process and of its reaped children (the forked points)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + ru.ru_utime + ru.ru_stime


def run_digest(world: World) -> str:
    """sha256 of how a run ended: the live syncer's state of every fragment (version,
    cycle, outer steps, the bytes of its value, published value and momentum), every
    manifest's contributions (key, status) and the virtual end time and event count.
    Not the bucket's bytes: run ids, nonces and payload names are random (uuid4) in the
    real code, so two runs of one seed differ in them and nothing else."""
    h = hashlib.sha256()
    live = world.syncer.syncer
    for p, state in sorted(live.states.items()) if live is not None else ():
        value = state.current
        h.update(repr((p, value.version, value.cycle, value.outer.num_steps)).encode())
        for tensors in (value.raw, value.published, value.outer.state_tensors()):
            for key in sorted(tensors):
                h.update(key.encode() + tensors[key].contiguous().numpy().tobytes())
    for p in range(world.plan.num_fragments):
        for v in range(1, (ledger.latest_version(world.admin, p) or 0) + 1):
            manifest = ledger.read_manifest(world.admin, p, v, run_id=world.run_id)
            h.update(repr([(e["key"], e.get("status"), e.get("used")) for e in manifest["contributions"]]).encode())
    h.update(repr((world.loop.now, world.loop.num_events)).encode())
    return h.hexdigest()


@dataclass
class Forker:
    """Forks a child at each point ``select`` accepts; at most ``jobs`` children at once."""

    jobs: int = 1
    select: Callable[[Point], bool] = lambda point: True
    child: bool = False  # this process is a forked child
    results: list[tuple[Point, dict[str, Any]]] = field(default_factory=list)
    _running: list[tuple[int, int, Point]] = field(default_factory=list)
    _wfd: int = -1

    def split(self, point: Point) -> bool:
        """Fork at ``point``: True in the child (which is to crash there), False in the parent."""
        if self.child or not self.select(point):
            return False
        while len(self._running) >= self.jobs:
            self._reap()
        sys.stdout.flush()
        sys.stderr.flush()
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(rfd)
            for _, fd, _ in self._running:
                os.close(fd)
            self.child, self._wfd, self._running = True, wfd, []
            return True
        os.close(wfd)
        self._running.append((pid, rfd, point))
        return False

    def report(self, result: dict[str, Any]) -> None:
        """The child's end: its result into the pipe, then exit at once."""
        data = json.dumps(result).encode()[:MAX_REPORT]
        try:
            os.write(self._wfd, data)
        finally:
            os._exit(0)

    def _reap(self) -> None:
        pid, rfd, point = self._running.pop(0)
        chunks = []
        while chunk := os.read(rfd, 65536):
            chunks.append(chunk)
        os.close(rfd)
        _, status = os.waitpid(pid, 0)
        try:
            result = json.loads(b"".join(chunks))
        except ValueError:
            result = {"problems": [f"the child exited (status {status}) without a readable report"], "fired": False}
        self.results.append((point, result))

    def drain(self) -> None:
        while self._running:
            self._reap()


def run_seed(scenario: Scenario, *, jobs: int = 1, select: Callable[[Point], bool] = lambda p: True,
             digest: bool = False) -> tuple[list[str], list[tuple[Point, dict[str, Any]]], CrashPlan]:
    """The uncrashed run of ``scenario``, forking a crashed copy at every point ``select``
    accepts. Returns the uncrashed run's problems, each point's result (``problems``,
    ``fired``, with ``digest`` the run's ``run_digest``) and the uncrashed run's plan."""
    torch.set_num_threads(1)
    world = World(scenario)
    forker = Forker(jobs=jobs, select=select)
    plan = CrashPlan(world, None, forker=forker)
    world.bucket.crash = plan
    try:
        world.run(final_eval=False)
        if forker.child:
            result = {"problems": verify(world), "fired": plan.fired, "crashes": len(world.loop.crashes)}
            if digest:
                result["digest"] = run_digest(world)
            forker.report(result)
    except BaseException as exc:  # noqa: BLE001 - a child must report, whatever happened
        if forker.child:
            forker.report({"problems": [f"the crashed run raised {exc!r}: {traceback.format_exc()[-2000:]}"],
                           "fired": plan.fired})
        forker.drain()
        raise
    forker.drain()
    return verify(world), forker.results, plan
