"""Rich views of ``ddiloco status`` and ``ddiloco inspect`` (CLI layer only).

Pure functions from the dicts of ``ddiloco_cli.ops.observe`` to Rich renderables,
plus ``watch_status``, the ``status --watch`` loop.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ddiloco_cli.errors import DdilocoError
from ddiloco_cli.protocol.fragspec import format_fragment_spec

MAX_ROWS = 20  # longer lists are cut, with a "... N more" row
COMPACT_FRAGMENTS = 12  # above this many fragments, status shows a summary instead of one row each


def fmt_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def fmt_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def fmt_num(x: float | int | None, spec: str = ",.0f") -> str:
    return "-" if x is None else format(x, spec)


def fmt_fragments(frags: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'; '-' for none."""
    return format_fragment_spec(frags) or "-"


def _alive(alive: bool, state: str = "running") -> Text:
    """The one state cell: "● running" (alive, its own word for what it does), "○ down"
    (no heartbeat while it meant to run), "○ left" / "○ finished" (gone on purpose)."""
    if alive:
        return Text(f"● {state}", style="green")
    # a learner that left or finished on purpose is not a failure
    return Text("○ down", style="red") if state in ("running", "serving") else Text(f"○ {state}", style="dim")


def _table(title: str, *columns: str) -> Table:
    table = Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for c in columns:
        table.add_column(c, justify="left" if c in ("learner", "syncer", "key", "reason", "state", "fragments",
                                                     "field", "value", "category", "id", "role", "admitted",
                                                     "problem") else "right")
    return table


def _cut(table: Table, rows: list[tuple], ncols: int) -> Table:
    for row in rows[:MAX_ROWS]:
        table.add_row(*row)
    if len(rows) > MAX_ROWS:
        table.add_row(f"... {len(rows) - MAX_ROWS} more", *[""] * (ncols - 1))
    return table


def _stack(parts: list[RenderableType]) -> Group:
    """Sections one under another, a blank line between two tables."""
    out: list[RenderableType] = []
    for part in parts:
        if out and isinstance(part, Table):
            out.append(Text(""))
        out.append(part)
    return Group(*out)


# ------------------------------------------------------------------------ status
def traffic_line(c: Any, *, num_params: int) -> str:
    """One line for `init`: about what a learner of a run of config ``c`` (a ``RunConfig``)
    moves per cycle, and the link that carries it at 1 s per step (``runfigures.traffic_per_cycle``)."""
    from ddiloco_cli.ops.runfigures import traffic_per_cycle

    t = traffic_per_cycle(codec=c.codec, publish_codec=c.publish_codec, codec_qmax=c.codec_qmax,
                          codec_density=c.codec_density, publish_density=c.publish_density,
                          num_params=num_params, sync_every=c.sync_every)
    line = (f"traffic per learner: about {fmt_bytes(t['up_bytes'])} up and {fmt_bytes(t['down_bytes'])} down per cycle "
            f"of {c.sync_every} steps ({num_params:,} params x {t['up_b_per_param']:.3g} / {t['down_b_per_param']:.3g} "
            f"B/param, {c.codec} / {c.publish_codec}): {t['mbps_at_1s']:,.3g} Mbps each way at 1 s per step")
    if c.codec != "sparse" and t["mbps_at_1s"] > 100:
        line += " (over a 100 Mbps link learners wait on uploads: `--codec sparse` sends about 10x fewer bytes, docs/sparse.md)"
    return line


def render_status(status: dict[str, Any]) -> RenderableType:
    """Header lines, alerts (red), fragments (a table, or a summary when there are many),
    learners, syncers."""
    g, b, t = status["goodput"], status["bytes"], status["throughput"]
    header = Text.assemble(
        ("run ", "bold"), (status["run_id"][:12], "cyan"),
        f"  {status['task']}  {status['mode']}  P={status['num_fragments']} K={status['quorum']}"
        f"  {status['num_params']:,} params  age {fmt_age(status['run_age_s'])}\n",
        ("throughput ", "bold"), f"{fmt_num(t['tokens_per_s'])} tok/s",
        f"  ETA to {status['total_steps']:,} steps {fmt_age(t['eta_s'])}   " if status["total_steps"] else "   ",
        ("goodput ", "bold"), "-" if g["goodput"] is None else f"{g['goodput']:.1%}",
        f" ({g['tokens']:,} tokens trained in {fmt_age(status['training_age_s'])}; about {g['possible_tokens']:,} "
        "possible at current rates)\n",
        ("bytes ", "bold"), f"up {fmt_bytes(b['bytes_up'])} down {fmt_bytes(b['bytes_down'])}"
        f"  vs data-parallel {fmt_bytes(b['data_parallel_bytes'])}",
        "" if b["reduction"] is None else f" ({b['reduction']:,.0f}x less)",
    )
    if status.get("global_eval"):
        e = status["global_eval"]
        header.append_text(Text.assemble("\n", ("global val loss ", "bold"), f"{e['val_loss']:.4f}",
                                         f" ({fmt_age(status['now_s'] - e['t'])} ago, after {e['step']:,} merges)"))
    parts: list[RenderableType] = [header]
    parts += [Text(f"ALERT: {alert}", style="bold red") for alert in status["alerts"]]
    parts.append(_fragments_view(status["fragments"]))

    learners = _table("learners", "learner", "state", "step", "tokens", "tok/s", "loss", "behind", "lag",
                      "ddiloco", "last contrib", "eta", "up", "down", "blocked", "beat")
    rows = [(r["learner_id"], _alive(r["alive"], r["state"]), fmt_num(r["step"]), fmt_num(r["tokens"]),
             fmt_num(r["tokens_per_s"]), fmt_num(r["loss"], ".3f"), fmt_num(r["versions_behind"]),
             "-" if r.get("lag_p50") is None else f"{r['lag_p50']}/{r['lag_p95']}",
             "-" if r.get("sync_share") is None else f"{r['sync_share']:.1%}",
             fmt_age(r["last_contribution_age_s"]), fmt_age(r["eta_s"]), fmt_bytes(r["bytes_up"]),
             fmt_bytes(r["bytes_down"]), fmt_age(r["blocked_s"]), fmt_age(r["heartbeat_age_s"]))
            for r in status["learners"]]
    parts.append(_cut(learners, rows, 15) if rows else Text("learners: none yet", style="dim"))

    syncers = _table("syncers", "epoch", "syncer", "state", "fragments", "beat", "lag", "backlog", "merges",
                     "repairs")
    rows = [(str(s["epoch"]), s["syncer_id"], _alive(s["alive"], s["state"]), fmt_fragments(s["fragments"]),
             fmt_age(s["heartbeat_age_s"]), fmt_num(s["lag_versions"]), str(s["backlog"]), fmt_num(s["num_merges"]),
             fmt_num(s.get("num_repairs"))) for s in status["syncers"]]
    parts.append(_cut(syncers, rows, 8) if rows else Text("syncers: none serving", style="yellow"))
    parts += [Text(f"repaired by syncer epoch {s['epoch']}: {r}", style="yellow")
              for s in status["syncers"] for r in s.get("repairs", [])[-3:]]
    for line in [*status.get("notes", []), *status.get("errors", [])]:
        parts.append(Text(f"warning: {line}", style="yellow"))
    return _stack(parts)


def status_line(status: dict[str, Any]) -> str:
    """One plain line of the run's state (``status --watch`` off a terminal, ``status --check``)."""
    versions = [f["version"] for f in status["fragments"] if f["version"] is not None]
    span = "-" if not versions else f"v{min(versions)}" if min(versions) == max(versions) else \
        f"v{min(versions)}..{max(versions)}"
    g, t = status["goodput"]["goodput"], status["throughput"]
    learners = status["learners"]
    line = (f"{time.strftime('%H:%M:%S')} run {status['run_id'][:12]} fragments {span} "
            f"learners {sum(r['alive'] for r in learners)}/{len(learners)} alive "
            f"syncers {sum(s['alive'] for s in status['syncers'])} alive "
            f"{fmt_num(t['tokens_per_s'])} tok/s eta {fmt_age(t['eta_s'])} "
            f"goodput {'-' if g is None else f'{g:.1%}'} "
            f"pending {sum(f['pending'] for f in status['fragments'])}")
    return line + "".join(f" | ALERT: {a}" for a in status["alerts"])


def _fragments_view(fragments: list[dict[str, Any]]) -> RenderableType:
    if len(fragments) <= COMPACT_FRAGMENTS:
        table = _table("fragments", "fragment", "version", "quorum", "epoch", "age", "pending")
        for f in fragments:
            table.add_row(str(f["fragment"]), fmt_num(f["version"]), fmt_num(f["quorum_size"]), fmt_num(f["epoch"]),
                          fmt_age(f["age_s"]), str(f["pending"]))
        return table
    versions = [f["version"] for f in fragments if f["version"] is not None]
    ages = sorted(f["age_s"] for f in fragments if f["age_s"] is not None)
    stalest = sorted((f for f in fragments if f["age_s"] is not None), key=lambda f: -f["age_s"])[:3]
    return Text.assemble(
        ("fragments ", "bold"),
        f"{len(fragments)}: versions {min(versions, default='-')}..{max(versions, default='-')}, "
        f"median age {fmt_age(ages[len(ages) // 2] if ages else None)}, "
        f"pending {sum(f['pending'] for f in fragments)}; stalest: "
        + ", ".join(f"p{f['fragment']} v{f['version']} ({fmt_age(f['age_s'])})" for f in stalest),
    )


def watch_status(console: Console, fetch: Callable[[], dict[str, Any]], *, interval_s: float, live: bool) -> None:
    """Show ``fetch()`` every ``interval_s`` seconds until Ctrl-C: redrawn in place
    (``live``, for a terminal) or as one ``status_line`` per refresh (for logs and pipes).

    A failing fetch (bucket unreachable, run gone) shows its error and keeps trying."""

    def error_line(exc: DdilocoError) -> str:
        return f"{time.strftime('%H:%M:%S')} error: {exc} (retrying every {interval_s:g}s)"

    if not live:
        try:
            while True:
                try:
                    console.print(status_line(fetch()), highlight=False, soft_wrap=True, markup=False)
                except DdilocoError as exc:
                    console.print(error_line(exc), highlight=False, soft_wrap=True, markup=False)
                console.file.flush()
                time.sleep(interval_s)
        except KeyboardInterrupt:
            return

    def frame() -> RenderableType:
        try:
            return render_status(fetch())
        except DdilocoError as exc:
            return Text(error_line(exc), style="red")

    with Live(frame(), console=console, auto_refresh=False) as live_view:
        try:
            while True:
                time.sleep(interval_s)
                live_view.update(frame(), refresh=True)
        except KeyboardInterrupt:
            pass


# ----------------------------------------------------------------------- inspect
def _inspect_run_view(run: dict[str, Any] | None) -> RenderableType:
    if run is None:
        return Text("run config: unreadable (see errors)", style="red")
    table = _table("run", "field", "value")
    for k, v in run.items():
        if k == "created_s" and v is not None:
            v = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(v))
        table.add_row(k, f"{v:,}" if k == "num_params" and v is not None else str(v))
    return table


def _inspect_fragments_view(fragments: list[dict[str, Any]]) -> RenderableType:
    table = _table("fragments", "fragment", "params", "versions", "count", "keyframe", "latest epoch", "quorum",
                   "age", "payloads", "pending", "merged, not collected")
    rows = []
    for f in fragments:
        latest = f["latest"] or {}
        span = "-" if f["oldest_version"] is None else f"{f['oldest_version']}..{f['newest_version']}"
        rows.append((str(f["fragment"]), fmt_num(f["num_params"]), span, str(f["num_versions"]),
                     fmt_num(f.get("newest_keyframe")), fmt_num(latest.get("epoch")), fmt_num(latest.get("quorum_size")), fmt_age(latest.get("age_s")),
                     f"{f['num_payloads']} / {fmt_bytes(f['payload_bytes'])}", str(f["num_pending"]),
                     str(f["num_merged_uncollected"])))
    return _cut(table, rows, 10)


def render_inspect(report: dict[str, Any]) -> RenderableType:
    """Sections: run config, fragments, epochs, syncer and learner heartbeats, quarantine,
    objects by category, orphans, errors."""
    parts: list[RenderableType] = [Text.assemble(("bucket ", "bold"), report["url"]),
                                   _inspect_run_view(report["run"]), _inspect_fragments_view(report["fragments"])]

    table = _table("epochs", "epoch", "syncer", "fragments", "age")
    rows = [(str(e["epoch"]), e["syncer_id"], fmt_fragments(e["fragments"]), fmt_age(e["age_s"]))
            for e in reversed(report["epochs"])]
    parts.append(_cut(table, rows, 4) if rows else Text("epochs: none claimed", style="dim"))

    table = _table("syncer heartbeats", "epoch", "syncer", "state", "fragments", "age")
    rows = [(str(s["epoch"]), s["syncer_id"], s["state"], fmt_fragments(s["fragments"]), fmt_age(s["age_s"]))
            for s in sorted(report["syncers"], key=lambda s: -s["epoch"])]
    if rows:
        parts.append(_cut(table, rows, 5))

    table = _table("learner heartbeats", "learner", "state", "step", "tokens", "age")
    rows = [(r["learner_id"], r["state"], fmt_num(r["step"]), fmt_num(r["tokens"]), fmt_age(r["age_s"]))
            for r in report["learners"]]
    parts.append(_cut(table, rows, 5) if rows else Text("learners: none yet", style="dim"))

    if report["quarantined"]:
        table = _table("quarantined", "key", "reason", "age")
        rows = [(q["key"], q["reason"], fmt_age(q["age_s"])) for q in report["quarantined"]]
        parts.append(_cut(table, rows, 3))

    table = _table("objects", "category", "count", "bytes")
    for category, c in report["objects"].items():
        table.add_row(category, f"{c['count']:,}", fmt_bytes(c["bytes"]))
    parts.append(table)

    if report["orphans"]:
        table = _table("orphans", "key", "size", "age", "reason")
        rows = [(o["key"], fmt_bytes(o["size"]), fmt_age(o["age_s"]), o["reason"]) for o in report["orphans"]]
        parts.append(_cut(table, rows, 4))
    if report.get("signatures") is not None:
        parts.append(_admissions_view(report["signatures"]["required"], report["signatures"]["admissions"]))
    for error in report["errors"]:
        parts.append(Text(f"error: {error}", style="red"))
    return _stack(parts)


def render_admissions(run: dict[str, Any], admissions: list[dict[str, Any]]) -> RenderableType:
    """`ddiloco keys list`: whether the run requires signatures, then its admissions."""
    return _admissions_view(run.get("require_signatures") is True, admissions)


def _admissions_view(required: bool, admissions: list[dict[str, Any]]) -> RenderableType:
    if not required:
        return Text("signatures: not required (anyone with write access to the bucket can contribute)", style="dim")
    table = _table(f"admissions (signatures required; {len(admissions)})", "id", "role", "key", "admitted", "problem")
    rows = [(a["id"], a["role"] or "-", f"{a['fingerprint']}..." if a["fingerprint"] else "-",
             time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(a["admitted_s"])) if a["admitted_s"] else "-",
             a["problem"] or "") for a in admissions]
    return _cut(table, rows, 5) if rows else Text("signatures: required; no key admitted yet (`ddiloco admit`)",
                                                  style="yellow")
