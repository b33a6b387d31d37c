"""``ddiloco simulate --train``: load the scenario, run it, print the table, write the JSON."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from ddiloco_cli.simtrain.report import simulate_train, table
from ddiloco_cli.simtrain.scenario import load_scenario


def simulate_train_command(console: Any, *, scenario: str | None, quick: bool, learners: int | None,
                           seed: int | None, steps_per_learner: int | None, json_file: str | None,
                           json_out: bool) -> dict[str, Any]:
    sc = load_scenario(scenario, quick=quick, learners=learners, seed=seed, steps_per_learner=steps_per_learner)
    # the real code's warnings (a stall alert while the syncer is out) are part of a scenario, not news
    logging.getLogger("ddiloco_cli").setLevel(logging.ERROR)
    result = simulate_train(sc, progress=lambda msg: print(f"[simulate] {msg}", file=sys.stderr))
    text = json.dumps(result, indent=1, default=str)
    if json_file:
        with open(json_file, "w") as f:
            f.write(text + "\n")
    if json_out:
        console.print_json(text)
    else:
        console.print(table(result), highlight=False, markup=False)
    return result
