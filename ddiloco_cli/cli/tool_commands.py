"""`ddiloco demo` and `ddiloco simulate`."""

from __future__ import annotations

import json
from enum import Enum
from typing import Annotated, Optional

import typer

from ddiloco_cli.cli.base import JsonOut, _number, app, console, out


# ----------------------------------------------------------------------- tools
@app.command()
def demo(
    workdir: Annotated[str, typer.Option(metavar="DIR", help="Directory for the bucket, logs and plot")] = "runs/demo",
    learners: Annotated[int, typer.Option(metavar="N", min=1, help="Number of learners")] = 3,
    duration: Annotated[float, typer.Option(metavar="SECONDS", parser=_number("--duration", positive=True),
                                            help="Approximate training time")] = 150.0,
    kill: Annotated[bool, typer.Option("--kill/--no-kill", metavar="",
                                       help="kill -9 one learner half-way and restart it")] = True,
) -> None:
    """A real run on a local-directory bucket: init, one syncer and several learners as
    subprocesses on the built-in GPT and Shakespeare; ends with a summary and a plot."""
    from ddiloco_cli.ops.demo import run_demo

    run_demo(workdir=workdir, num_learners=learners, duration_s=duration, kill=kill, console=console)


class SimMode(str, Enum):
    data_parallel = "data-parallel"
    elastic_data_parallel = "elastic-data-parallel"
    decoupled = "decoupled"


@app.command()
def simulate(
    mode: Annotated[SimMode, typer.Option(help="Training scheme to simulate")] = SimMode.decoupled,
    chips: Annotated[int, typer.Option(metavar="N", min=1, help="Number of chips")] = 1_200_000,
    learners: Annotated[Optional[int], typer.Option(metavar="M", min=1, help="Learners M (default 8; "
                                                    "--train: the scenario's)")] = None,
    mtbi_years: Annotated[float, typer.Option(metavar="YEARS", parser=_number("--mtbi-years", positive=True),
                                              help="Mean time between interruptions per chip, years")] = 1.0,
    quorum: Annotated[int, typer.Option(metavar="K", min=1, help="Quorum K (decoupled)")] = 1,
    seed: Annotated[Optional[int], typer.Option(metavar="N", min=0)] = None,
    train: Annotated[bool, typer.Option("--train", metavar="", help="Simulate a whole training run: the real syncer and "
                                        "learner code on a virtual clock (docs/simulation.md)")] = False,
    steps_per_learner: Annotated[Optional[int], typer.Option(metavar="N", min=1, help="--train: inner steps "
                                                             "per learner")] = None,
    scenario: Annotated[Optional[str], typer.Option(metavar="FILE", help="--train: a scenario (TOML)")] = None,
    quick: Annotated[bool, typer.Option("--quick", metavar="", help="--train: the small scenario CI runs")] = False,
    json_file: Annotated[Optional[str], typer.Option(metavar="PATH", help="--train: also write the report "
                                                     "(JSON) here")] = None,
    json_out: JsonOut = False,
) -> None:
    """Discrete-event goodput simulator of training at scale (see docs/simulator.md); with
    --train, a deterministic simulation of a whole run (see docs/simulation.md)."""
    if train:
        from ddiloco_cli.simtrain.cli import simulate_train_command

        simulate_train_command(out, scenario=scenario, quick=quick, learners=learners, seed=seed,
                               steps_per_learner=steps_per_learner, json_file=json_file, json_out=json_out)
        return
    from ddiloco_cli.simtrain.goodput import simulate as run_sim

    learners = learners or 8
    result = run_sim(mode=mode.value, chips=chips, learners=learners if mode is SimMode.decoupled else 1,
                     mtbi_years=mtbi_years, quorum=quorum, seed=seed or 0)
    if json_out:
        out.print_json(json.dumps(result))
    else:
        out.print(f"{mode.value}: goodput {result['goodput']:.1%}, uptime {result['uptime']:.1%}")
