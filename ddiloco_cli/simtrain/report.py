"""``simulate_train``: run the arms of one scenario and report them.

The JSON's top level has one object per arm, ``decoupled``, ``sync`` and ``dp``, each
with ``val_loss``; ``decoupled`` also has ``ratio_to_sync`` and ``ratio_to_dp``. With the
dp arm, ``decoupled`` and ``sync`` have ``time_to_dp_loss_s`` (None: not reached) and
``dp`` has ``time_to_final_s``: times to data-parallel's final loss.
Scripts and monitors read these keys: keep them stable.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from ddiloco_cli.simtrain.arms import dp_step_s, run_dp, run_sync, sync_time_s
from ddiloco_cli.simtrain.scenario import Scenario
from ddiloco_cli.simtrain.world import World


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def time_to_reach(curve: list[tuple[float, float]], target: float) -> float | None:
    """The first time the (time, val loss) curve reaches ``target`` (linear between points)."""
    prev = None
    for t, v in curve:
        if v <= target:
            if prev is None or prev[1] == v:
                return t
            t0, v0 = prev
            return t0 + (t - t0) * (v0 - target) / (v0 - v)
        prev = (t, v)
    return None


def _decoupled(world: World) -> dict[str, Any]:
    sc = world.scenario
    reports = [learner.final_report() for learner in world.learners]
    lags = [lag for r in reports for lag in r.lags]
    end_s = world.loop.now
    ups, downs = [r.bytes_up for r in reports], [r.bytes_down for r in reports]
    merged = world.ledger_summary()
    return {
        "val_loss": world.final_val,
        "virtual_s": end_s,
        "curve": [{"t_s": p.t_s, "tokens": p.tokens, "val_loss": p.val_loss} for p in world.curve],
        "ledger": merged,
        "lag_steps_p50": percentile(lags, 0.5), "lag_steps_p95": percentile(lags, 0.95),
        "receives": len(lags), "held_receives": sum(r.held for r in reports),
        "bytes_up_per_learner": statistics.mean(ups), "bytes_down_per_learner": statistics.mean(downs),
        "goodput_tokens_per_s": world.tokens * merged["merged_token_fraction"] / max(1e-9, end_s),
        "syncer_utilisation": sum(s.busy_s for s in world.syncers) / max(1e-9, end_s),
        "syncer_merge_s": sum(s.total_merge_s() for s in world.syncers),
        "syncer_epochs": sum(s.starts for s in world.syncers),
        "blocked_s_per_learner": statistics.mean(r.blocked_s for r in reports),
        "preemptions": sum(r.preemptions for r in reports),
        "sessions": sum(r.sessions for r in reports),
        "requests": world.bucket.num_requests,
        "events": world.loop.num_events,
        "cpu_s": world.wall_s,
    }


def add_times_to_loss(arms: dict[str, Any], scenario: Scenario, *, num_params: float, sync_every: int) -> None:
    """Every arm's time to data-parallel's final loss at a model of ``num_params`` parameters,
    into ``arms`` (``dp`` required; ``decoupled`` and ``sync`` when there): the decoupled curve
    is in its simulated time already, the references' curves go through their time models."""
    target, dp = arms["dp"]["val_loss"], arms["dp"]
    dp["step_s"] = dp_step_s(scenario, num_params)
    dp["time_to_final_s"] = (scenario.dp_steps or scenario.steps_per_learner) * dp["step_s"]
    if "decoupled" in arms:
        dec = arms["decoupled"]
        curve = [(p["t_s"], p["val_loss"]) for p in dec["curve"]] + [(dec["virtual_s"], dec["val_loss"])]
        dec["time_to_dp_loss_s"] = time_to_reach(curve, target)
    if "sync" in arms:
        sync = arms["sync"]
        sync["time_s"] = sync_time_s(scenario, num_params, scenario.steps_per_learner, sync_every)
        sync["time_to_dp_loss_s"] = time_to_reach(
            [(sync_time_s(scenario, num_params, step, sync_every), v) for step, v in sync["curve_steps"]], target)


def simulate_train(scenario: Scenario, *, progress=lambda _msg: None) -> dict[str, Any]:
    """Run the scenario's arms; returns the report (see the module docstring)."""
    torch.set_num_threads(1)  # one thread: the same float reductions whatever the host
    t0 = time.process_time()
    world = World(scenario)
    progress(f"decoupled: M={scenario.learners} x {scenario.steps_per_learner} steps")
    world.run()
    out: dict[str, Any] = {"decoupled": _decoupled(world)}
    config, task, inner = world.config, world.task, world.inner
    if "sync" in scenario.arms:
        progress("sync (classic DiLoCo)")
        out["sync"] = run_sync(task, scenario, config, inner, curve="dp" in scenario.arms)
    if "dp" in scenario.arms:
        progress("dp (data-parallel)")
        out["dp"] = run_dp(task, scenario, config, inner)
    dec = out["decoupled"]
    dec["ratio_to_sync"] = dec["val_loss"] / out["sync"]["val_loss"] if "sync" in out else None
    dec["ratio_to_dp"] = dec["val_loss"] / out["dp"]["val_loss"] if "dp" in out else None
    if "dp" in out:
        add_times_to_loss(out, scenario, num_params=scenario.model_params or world.num_params,
                          sync_every=config.sync_every)
    out["scenario"] = {k: v for k, v in vars(scenario).items()}
    out["cpu_s"] = time.process_time() - t0
    return out


def table(result: dict[str, Any]) -> str:
    """The report as text."""
    dec, lines = result["decoupled"], []
    sc = result["scenario"]
    lines.append(f"M={sc['learners']} x {sc['steps_per_learner']} steps, seed {sc['seed']}, step {sc['step_s']} s "
                 f"({sc['speeds']}), link {sc['up_mbps']:g}/{sc['down_mbps']:g} Mbps {sc['rtt_ms']:g} ms")
    lines.append(f"{'arm':<10} {'val_loss':>9} {'x sync':>8} {'x dp':>8}")
    lines.append(f"{'decoupled':<10} {dec['val_loss']:>9.4f} {_fmt(dec['ratio_to_sync']):>8} {_fmt(dec['ratio_to_dp']):>8}")
    for arm in ("sync", "dp"):
        if arm in result:
            lines.append(f"{arm:<10} {result[arm]['val_loss']:>9.4f}")
    led = dec["ledger"]
    lines.append(f"ledger: used {led['used']} superseded {led['superseded']} refused {led['refused']}, merged token "
                 f"fraction {led['merged_token_fraction']:.3f}, mean quorum {led['mean_quorum']:.2f}, versions per "
                 f"fragment per cycle {led['versions_per_fragment_per_cycle']:.2f}")
    lines.append(f"send->receive lag p50 {dec['lag_steps_p50']} p95 {dec['lag_steps_p95']} steps, held versions "
                 f"taken {dec['held_receives']} of {dec['receives']} receives; per learner up "
                 f"{dec['bytes_up_per_learner'] / 1e6:.2f} MB down {dec['bytes_down_per_learner'] / 1e6:.2f} MB; "
                 f"syncer busy {dec['syncer_utilisation']:.1%}; preemptions {dec['preemptions']}")
    if "dp" in result:
        dp = result["dp"]
        size = f"{sc['model_params']:.3g}-parameter model" if sc.get("model_params") else "the simulated model"
        times = [f"decoupled {duration(dec.get('time_to_dp_loss_s'))}"]
        if "sync" in result:
            times.append(f"sync {duration(result['sync'].get('time_to_dp_loss_s'))}")
        times.append(f"dp {duration(dp['time_to_final_s'])} ({dp['step_s']:.3g} s/step, "
                     f"{sc.get('dp_steps') or sc['steps_per_learner']} steps)")
        lines.append(f"time to dp's final loss {dp['val_loss']:.4f} ({size}): " + ", ".join(times))
    lines.append("val loss vs time: " + ", ".join(f"{p['t_s']:.0f}s {p['val_loss']:.3f}" for p in dec["curve"]))
    lines.append(f"virtual {dec['virtual_s']:.0f} s; cpu {result['cpu_s']:.0f} s ({dec['events']} events)")
    return "\n".join(lines)


def duration(seconds: float | None) -> str:
    """A time to a loss as text: seconds, minutes or hours; None is not reached."""
    if seconds is None:
        return "not reached"
    if seconds < 600:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 36000 else f"{seconds / 3600:.1f} h"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"
