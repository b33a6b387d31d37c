"""The learner side of a run, by role:

* ``sync``: ``DiLoCoSync``, the wrapper any training loop uses (counters, sends,
  receives, worker threads, the session);
* ``learn``: ``ddiloco learn``, a nanoGPT-like loop on top of it;
* ``uploader``: the contribution upload queue;
* ``receiver``: the background receiver and the pure receive rule;
* ``session``: the learner's heartbeat and data-state records, one live session
  per id, and alerts;
* ``island``: torchrun ranks (DDP, FSDP2) of one learner and device selection;
* ``stats``: the counters they share;
* ``progress``: the resume line, the plain progress line and the session summary.
"""

from ddiloco_cli.learner.learn import Learner, LearnerOptions, lr_at
from ddiloco_cli.learner.receiver import InFlight, Receiver, receive_rule
from ddiloco_cli.learner.stats import LearnerStats
from ddiloco_cli.learner.sync import DiLoCoSync, SyncOptions
from ddiloco_cli.learner.uploader import Uploader

__all__ = ["DiLoCoSync", "SyncOptions", "Learner", "LearnerOptions", "lr_at", "InFlight", "Receiver", "receive_rule",
           "LearnerStats", "Uploader"]
