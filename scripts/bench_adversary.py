"""One bad learner among honest ones, on the deterministic simulation (issue 25).

4 honest learners train with a syncer on the virtual clock (``ddiloco_cli/simtrain``); in
each variant a 5th admitted learner trains too but tampers with what it uploads (its own
id, valid headers). Every variant is compared with the same seeded run of the 4 honest
learners alone. The run records ``max_tokens_per_step`` (batch x sequence), so the counter
bounds are on. Variants:

* ``huge``: its delta x 1000;
* ``flip10``: the sign-flipped delta x 10;
* ``counters``: c_tokens = 2^40 on every send, and c_steps = 2^40 (with c_tokens 2^45) on
  every other one;
* ``zeros``: zero deltas (at its normal rate; the simulation has one send per H steps);
* ``random_bound``: a random direction at NORM_BOUND_FACTOR (2) x its honest norm (about the
  clip bound) every send;
* ``replay``: its first contribution of each fragment sent again every time.

Per variant: the final global val loss and its ratio to the clean run (target <= 1.05),
honest contributions refused (target 0), the bad learner's entries clipped / share-capped,
and ``inspect --verify``'s problems; and the honest contributions the norm bound clipped
(``honest_clipped`` of ``honest_used``, the smallest factor): the bound's price, highest with
mixed speeds (``--speeds two`` / ``lognormal``). Prints one JSON object per line, then a summary.

    python scripts/bench_adversary.py --steps 96 --seed 0
    python scripts/bench_adversary.py --steps 96 --seed 0 --speeds two --variants ''  # clean only
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from ddiloco_cli.ops.verify import verify_run
from ddiloco_cli.protocol import ledger
from ddiloco_cli.simtrain.scenario import Scenario
from ddiloco_cli.simtrain.world import World
from ddiloco_cli.syncer import judge
from ddiloco_cli.tasks import load_task

VARIANTS = ("huge", "flip10", "counters", "zeros", "random_bound", "replay")


def tamper(variant: str, seed: int):
    """The bad learner's uploader.submit filter for ``variant``: (delta, header) -> (delta, header)."""
    g = torch.Generator().manual_seed(seed)
    first: dict[int, dict[str, torch.Tensor]] = {}
    sends = [0]

    def apply(delta: dict[str, torch.Tensor], header: dict) -> tuple[dict[str, torch.Tensor], dict]:
        p, header = header["fragment"], dict(header)
        sends[0] += 1
        if variant == "huge":
            delta = {k: 1000.0 * t for k, t in delta.items()}
        elif variant == "flip10":
            delta = {k: -10.0 * t for k, t in delta.items()}
        elif variant == "counters":
            header.update(c_tokens=2**45, c_steps=2**40) if sends[0] % 2 else header.update(c_tokens=2**40)
        elif variant == "zeros":
            delta = {k: torch.zeros_like(t) for k, t in delta.items()}
        elif variant == "random_bound":
            norm = torch.sqrt(sum((t.double() ** 2).sum() for t in delta.values()))
            rnd = {k: torch.randn(t.shape, generator=g) for k, t in delta.items()}
            rnorm = torch.sqrt(sum((t.double() ** 2).sum() for t in rnd.values()))
            delta = {k: (t * float(judge.NORM_BOUND_FACTOR * norm / rnorm)).to(torch.float32) for k, t in rnd.items()}
        elif variant == "replay":
            delta = first.setdefault(p, {k: t.clone() for k, t in delta.items()})
        return delta, header

    return apply


def _attach(world: World, variant: str, seed: int) -> str:
    """Make the last learner the bad one: its uploads pass through ``tamper``."""
    bad = world.learners[-1]
    start, change = bad.start, tamper(variant, seed)

    def start_bad() -> None:
        start()
        submit = bad.sync._uploader.submit
        bad.sync._uploader.submit = lambda key, delta, header: submit(key, *change(delta, header))

    bad.start = start_bad
    return bad.learner_id


SPEED = {"speeds": "constant"}  # --speeds (two: every other learner --slow-factor x slower; lognormal: --sigma)


def _scenario(learners: int, steps: int, seed: int, tokens_per_step: int) -> Scenario:
    return Scenario(learners=learners, steps_per_learner=steps, seed=seed, arms=("decoupled",), eval_points=0,
                    run={"max_tokens_per_step": tokens_per_step}, **SPEED)


def _ledger(world: World, bad_id: str | None) -> dict:
    out = {"honest_refused": 0, "honest_used": 0, "honest_clipped": 0, "honest_clip_min": 1.0, "bad_used": 0,
           "bad_clipped": 0, "bad_capped": 0, "bad_refused": 0}
    for p in range(world.plan.num_fragments):
        for v in range(1, (ledger.latest_version(world.admin, p) or 0) + 1):
            for e in ledger.read_manifest(world.admin, p, v, run_id=world.run_id)["contributions"]:
                bad = e["learner_id"] == bad_id
                if e.get("status") == "refused":
                    out["bad_refused" if bad else "honest_refused"] += 1
                if bad and e.get("used"):
                    out["bad_used"] += 1
                    out["bad_clipped"] += "clip" in e
                    out["bad_capped"] += "share_cap" in e
                elif e.get("used"):  # an honest one cut by the norm bound: the price of the bound
                    out["honest_used"] += 1
                    out["honest_clipped"] += "clip" in e
                    out["honest_clip_min"] = min(out["honest_clip_min"], e.get("clip", 1.0))
    return out


def run_one(variant: str | None, *, steps: int, seed: int, tokens_per_step: int) -> dict:
    t0 = time.process_time()
    torch.set_num_threads(1)
    world = World(_scenario(4 if variant is None else 5, steps, seed, tokens_per_step))
    bad_id = _attach(world, variant, seed) if variant else None
    error = None
    try:
        world.run()
    except Exception as exc:  # noqa: BLE001 - a bench reports, it does not stop
        error = f"{type(exc).__name__}: {exc}"
        world.final_val = float("nan")
    return {"variant": variant or "clean", "val_loss": world.final_val, "error": error,
            **_ledger(world, bad_id), "verify_problems": verify_run(world.admin),
            "cpu_s": round(time.process_time() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=96, help="inner steps per learner")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="also write every result to PATH")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--speeds", default="constant", choices=("constant", "two", "lognormal"))
    ap.add_argument("--slow-factor", type=float, default=1.5, help="--speeds two: the slow learners' factor")
    ap.add_argument("--sigma", type=float, default=0.5, help="--speeds lognormal: the speed factors' sigma")
    ap.add_argument("--norm-bound", type=float, default=None,
                    help=f"the clip bound in running medians (default: the syncer's, {judge.NORM_BOUND_FACTOR})")
    args = ap.parse_args(argv)
    SPEED.update(speeds=args.speeds, slow_factor=args.slow_factor, sigma=args.sigma)
    if args.norm_bound is not None:
        judge.NORM_BOUND_FACTOR = args.norm_bound
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}")
    config = _scenario(4, args.steps, args.seed, 1).run_config()
    tokens_per_step = config.batch_size * load_task(config.task).config.block_size
    clean = run_one(None, steps=args.steps, seed=args.seed, tokens_per_step=tokens_per_step)
    print(json.dumps(clean), flush=True)
    results, ok = [clean], clean["error"] is None
    for variant in variants:
        r = run_one(variant, steps=args.steps, seed=args.seed, tokens_per_step=tokens_per_step)
        r["ratio_to_clean"] = r["val_loss"] / clean["val_loss"]
        r["pass"] = (r["error"] is None and r["ratio_to_clean"] <= 1.05 and r["honest_refused"] == 0)
        ok &= r["pass"]
        results.append(r)
        print(json.dumps(r), flush=True)
    print(json.dumps({"summary": "pass" if ok else "FAIL", "clean_val_loss": clean["val_loss"]}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "seed": args.seed, **SPEED, "norm_bound": judge.NORM_BOUND_FACTOR,
                   "results": results, "pass": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
