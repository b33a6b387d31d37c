"""What a learner reports about itself in its heartbeat: its counters, its send ->
receive lags and what ddiloco costs its steps (``stats.CostMeter``). ``DiLoCoSync`` is built on
it; the state it reads (the stats, the island, the worker threads) is DiLoCoSync's."""

from __future__ import annotations

import os
import socket
from typing import Any

from ddiloco_cli.ops.runfigures import cost_share
from ddiloco_cli.protocol import records
from ddiloco_cli.store.base import io_threads


class Reporting:
    """The heartbeat half of ``DiLoCoSync`` (a base class: the methods use its attributes)."""

    def _heartbeat_record(self) -> dict[str, Any]:
        s = self.stats
        host, pid = self.opts.process or (socket.gethostname(), os.getpid())
        return records.make(
            "learner_heartbeat", run_id=self.run_id, learner_id=self.learner_id, state=s.state, step=s.step,
            tokens=s.tokens, step_time_s=s.step_time_s, loss=s.loss, bytes_up=s.bytes_up, bytes_down=s.bytes_down,
            num_contributions=s.num_contributions, blocked_s=s.blocked_s, uploads_failed=s.uploads_failed,
            receives=s.num_receives, held_receives=s.num_held, refused=s.num_refused,
            **({"last_refusal": s.last_refusal} if s.last_refusal else {}), versions={str(p): v for p, v in s.versions.items()},
            device=str(self.island.device), session=self.session, host=host, pid=pid, started_s=self.started_s,
            first_started_s=self.first_started_s, time_s=self.clock.time(), schedule_offset=self.schedule_offset,
            **self._lag_fields(), **self._cost_fields(), **self.heartbeat_fields,
        )

    @property
    def cost_share(self) -> float | None:
        """ddiloco's share of this learner's steps as its latest heartbeat reported it
        (``runfigures.cost_share``: what `status` shows), None before two heartbeats."""
        f = self._cost.last
        return cost_share(f.get("sync_step_ms"), f.get("sync_step_cpu_ms"), f.get("sync_worker_cpu_ms"),
                          self.stats.step_time_s)

    def _cost_fields(self) -> dict[str, float]:
        """The heartbeat's cost fields (``stats.CostMeter``): host time, so a driver without
        threads (the deterministic simulation) reports none."""
        if not self.opts.threads or self._uploader is None:
            return {}
        if self._io is not None:  # the io helper process's CPU, and the heartbeat's
            return self._cost.fields(self.stats.step, [w for w in (self._writer, *io_threads(self.store)) if w],
                                     extra_cpu_s=self._io.cpu_s())
        # with the thread that makes the bucket's requests for them (GCS's; S3's but GETs and PUTs)
        workers = [*self._uploader.threads, self._receiver, self._writer, *io_threads(self.store)]
        return self._cost.fields(self.stats.step, [w for w in workers if w is not None])

    def _lag_fields(self) -> dict[str, int]:
        quantiles = self.stats.lag_quantiles()
        return {} if quantiles is None else {"lag_p50": quantiles[0], "lag_p95": quantiles[1]}
