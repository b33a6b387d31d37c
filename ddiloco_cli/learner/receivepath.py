"""The learner's receive path ([L8]): when a newer version of a fragment is taken (lock-step:
the one that settles our contribution; decoupled: that one at once, else the newest before the
fragment's next send) and how it is folded into the model. ``DiLoCoSync`` is built on it; the
state it reads (the receiver, the island, the plan, the counters) is DiLoCoSync's."""

from __future__ import annotations

import logging

import torch

from ddiloco_cli.learner.receiver import InFlight, Ready, receive_rule
from ddiloco_cli.learner.sendpath import copied_into

REASON_CHARS = 300  # the heartbeat's last_refusal (its schema's bound)

log = logging.getLogger("ddiloco_cli.learner.sync")  # the learner's lines keep their logger name

Tensors = dict[str, torch.Tensor]

ALERT_MIN_INTERVAL_S = 10.0  # stall alerts (decoupled and lock-step) come at most this often
LAG_WARN_AFTER = 16  # receives before a late-receive warning (the median of fewer says little)


class ReceivePath:
    """The receive half of ``DiLoCoSync`` (a base class: the methods use its attributes)."""

    _lag_warned = False  # the late-receive warning is given once a session

    def _add_to_params(self, p: int, increment: Tensors, alpha: float) -> None:
        """Add ``(1 - alpha) * increment`` (fp32, keyed by slice key) to fragment p of the model in
        place: no copy of the fragment out and back as ``receive_rule`` needs (with progress kept,
        alpha * theta + (1 - alpha) * (Theta_new + theta - theta_at_send) is that sum)."""
        views = [s.view_of(self.params[s.name]) for s in self.plan.fragments[p]]
        # on CUDA the increments are pinned (Receiver's ``pin``): copied without a stream sync, the
        # pinned blocks kept by torch's host allocator until their copies are done
        adds = [increment[s.key].to(v.device, non_blocking=v.is_cuda and increment[s.key].is_pinned())
                for s, v in zip(self.plan.fragments[p], views)]
        with torch.no_grad():
            torch._foreach_add_(views, adds, alpha=1.0 - alpha)  # alpha 0: x + 1 * y == x + y exactly

    def alert_every_s(self) -> float:
        """The least time between two stall alerts: the time 2*H steps take, at least
        ALERT_MIN_INTERVAL_S (each alert reads the syncers' heartbeats and writes a log line)."""
        return max(ALERT_MIN_INTERVAL_S, 2 * self.H * self.stats.step_time_s)

    def _take(self, p: int, flight: InFlight) -> Ready | None:
        """Rank 0: a ready newer version of p, or None (lock-step: wait for the one
        that merged our contribution; decoupled: ``_own_or_newest``)."""
        receiver = self._receiver
        t0 = self.clock.monotonic()
        alert_every_s = self.alert_every_s()
        next_alert = t0 + alert_every_s
        while True:
            got = receiver.take(p)
            if got is not None:
                for entry in got.refused:
                    # the ledger's word: that progress is gone; receiving this version re-bases p
                    reason = entry.get("reason") or "no reason given"
                    self.stats.num_refused += 1
                    self.stats.last_refusal = f"fragment {p} seq {entry['seq']}: {reason}"[:REASON_CHARS]
                    log.warning("fragment %d: contribution seq %d was refused by the syncer (%s): its progress is "
                                "not in version %d; re-basing on it", p, entry["seq"], reason, got.version)
            if got is not None and self.lockstep and not self._accounts_for(got, flight):
                receiver.want(p, (got.version, got.value), blocking=True)  # not ours yet: wait for a later one
                got = None
            if got is not None or not self.lockstep or self.stop_reason is not None:
                break
            now = self.clock.monotonic()
            if self.opts.stall_alert and now >= next_alert:
                self._writer.alert_waiting(step=self.stats.step, fragment=p, waited_s=now - t0)
                next_alert = now + alert_every_s
            self.clock.sleep(0.005)
        if self.lockstep:
            self.stats.blocked_s += self.clock.monotonic() - t0
        return self._own_or_newest(p, flight, got) if self.await_own else got

    def _accounts_for(self, got: Ready, flight: InFlight) -> bool:
        """Whether version ``got`` has settled the contribution sent with ``flight``: merged or
        superseded (the manifest's high-water mark), or refused."""
        return (got.manifest["high_water"].get(self.learner_id, -1) >= flight.seq
                or any(entry.get("seq") == flight.seq for entry in got.refused))

    def _last_step(self, flight: InFlight) -> int:
        """[L8] The last step that may take the version held for ``flight``: the next send of its
        fragment comes after it."""
        return flight.receive_step - self.tau + self.H - 1

    def _own_or_newest(self, p: int, flight: InFlight, got: Ready | None) -> Ready | None:
        """Decoupled [L8]: a version that settles the contribution in flight is taken at once; an
        earlier one is held back (the receiver goes on polling from it) until the step before the
        fragment's next send, which takes the newest version it has. Never waits."""
        last_step = self._last_step(flight)
        if got is not None and not self._accounts_for(got, flight) and self.stats.step < last_step:
            flight.held = got
            self._receiver.want(p, (got.version, got.value), subtract=flight.theta if self._in_place else None,
                                order=flight.seq)  # its place in line: the send's
            return None
        if got is None and self.stats.step >= last_step:
            got = flight.held
        return got

    def _receive(self, p: int, flight: InFlight) -> bool:
        """Fold a newer committed version of p into the model if one is ready.
        Returns True when p was received."""
        if self.island.world == 1 and not self.lockstep and not self._receiver.has_ready(p) and (
                not self.await_own or flight.held is None or self.stats.step < self._last_step(flight)):
            return False  # nothing to take (what _take would find): no lock, no agreement among ranks
        got = self._take(p, flight) if self.island.io else None
        # a version without this learner's contribution in flight ([L8]'s held one) takes held_alpha
        held = got is not None and not self.lockstep and not self._accounts_for(got, flight)
        version, held = self.island.agree([got.version if got is not None else -1, held])
        if version < 0:
            return False
        alpha = self.held_alpha if held else self.alpha
        self.stats.num_receives += 1
        self.stats.num_held += held
        version, value = self.island.broadcast(self.plan, p, version, got.value if got is not None else {})
        if self._in_place and got.increment is not None and got.subtracted is flight.theta:
            self._add_to_params(p, got.increment, alpha)
        elif alpha == 0.0 and not self.keep_progress:
            self.island.scatter(self.plan, p, self.params, value)
        else:
            local = self.island.gather(self.plan, p, self.params)
            new = receive_rule(local, value, flight.theta, alpha=alpha, keep_progress=self.keep_progress)
            self.island.scatter(self.plan, p, self.params, new)
        self._rebase(p, version, value)
        # the next contribution covers exactly the steps since this send (or since now)
        self.counters.reset(p, since=flight.counters if self.keep_progress else None)
        self.stats.versions[p] = version
        self._note_lag(self.stats.step - (flight.receive_step - self.tau))
        return True

    def _rebase(self, p: int, version: int, value: Tensors) -> None:
        """The base of p becomes ``value`` at ``version``, copied into the base's tensors
        (``copied_into``). The receiver reads a base only while p is wanted and not ready, and the
        version just taken ended that; an upload that has still to compute an outer gradient from
        the old base (``_lent``: its queue is behind) keeps it, and ``value`` becomes the base."""
        if self._io is not None:  # the io helper keeps the values: it takes this one as p's base
            self.base[p] = (version, None)
            self._io.took(p, version)
            return
        kept = self.base[p][1] if p in self.base and not self._lent(p) else None
        self.base[p] = (version, copied_into(kept, value))

    def _note_lag(self, lag: int) -> None:
        """Keep a receive's send -> receive lag (steps) for the heartbeat and `status`; warn once a
        session when the median of a full window is over tau: versions then come back after the
        step the learner expected them (the overlap window does not cover the syncer's round trip)."""
        self.stats.lags.append(lag)
        quantiles = self.stats.lag_quantiles()
        if (not self._lag_warned and not self.lockstep and len(self.stats.lags) >= LAG_WARN_AFTER
                and quantiles[0] > self.tau):
            self._lag_warned = True
            log.warning("versions come back a median %d steps after their send (p95 %d), over the overlap window "
                        "tau = %d: size --overlap-steps to about %d at the next init, or poll the syncer faster",
                        quantiles[0], quantiles[1], self.tau, quantiles[0])


__all__ = ["ALERT_MIN_INTERVAL_S", "ReceivePath"]
