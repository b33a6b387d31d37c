"""Deterministic simulation of a whole Decoupled DiLoCo run (``ddiloco simulate --train``).

The real syncer and learner code runs in one process and one thread on a virtual clock:

* ``scenario``: what a run is (M, steps, speeds, links, faults; TOML or flags);
* ``loop``: the seeded event loop, the actors' turn clocks and timers;
* ``bucket``: the in-memory bucket seen through per-actor stores that charge latency and
  bandwidth to the virtual clock, writes visible when they would have finished;
* ``learners``: a learner's training loop, uploads, receiver and heartbeat as actors;
* ``syncer``: the syncer's turns (``Syncer`` on a turn clock) and its outages;
* ``world``: one run: init, the actors, faults, the global model's val loss curve;
* ``arms``: the references on the same batches: data-parallel and classic DiLoCo;
* ``report``: ``simulate_train``, the JSON report and its table.

See docs/simulation.md.
"""

from ddiloco_cli.simtrain.report import simulate_train, table
from ddiloco_cli.simtrain.scenario import Scenario, load_scenario

__all__ = ["Scenario", "load_scenario", "simulate_train", "table"]
