"""Calibration table of the goodput simulator against the Decoupled DiLoCo paper.

Run (a few seconds on one CPU core):

    .venv/bin/python scripts/bench_simulate.py --json /tmp/bench_simulate.json

Prints, for 1.2M chips at 1-year MTBI per chip, the paper's goodput next to
ours for data-parallel, elastic data-parallel and Decoupled DiLoCo M=2/4/8/16,
then the same modes at other scales (default: 100k chips at MTBI 0.5 and 2
years; --scales CHIPS:YEARS ...) with the calibrated defaults unchanged.
"""

import argparse
import json
import time

from ddiloco_cli.simtrain.goodput import simulate

PAPER_CHIPS, PAPER_MTBI_YEARS = 1_200_000, 1.0
ROWS = [  # (label, mode, learners, paper goodput %)
    ("data-parallel", "data-parallel", 1, 27),
    ("elastic data-parallel", "elastic-data-parallel", 1, 58),
    ("decoupled M=2", "decoupled", 2, 70),
    ("decoupled M=4", "decoupled", 4, 82),
    ("decoupled M=8", "decoupled", 8, 88),
    ("decoupled M=16", "decoupled", 16, 93),
]


def run_column(*, chips: int, mtbi_years: float, seed: int) -> list[dict]:
    out = []
    for label, mode, learners, paper in ROWS:
        t0 = time.perf_counter()
        r = simulate(mode=mode, chips=chips, learners=learners, mtbi_years=mtbi_years, seed=seed)
        r["wall_s"] = time.perf_counter() - t0
        r["label"] = label
        r["paper_goodput"] = paper if (chips, mtbi_years) == (PAPER_CHIPS, PAPER_MTBI_YEARS) else None
        out.append(r)
    return out


def print_column(rows: list[dict], *, chips: int, mtbi_years: float) -> None:
    print(f"\n{chips:,} chips, MTBI {mtbi_years:g} year(s) per chip")
    print(f"{'mode':<24}{'paper':>7}{'goodput':>9}{'uptime':>9}{'failures':>10}{'sim days':>10}{'wall s':>8}")
    for r in rows:
        paper = f"{r['paper_goodput']}%" if r["paper_goodput"] is not None else "-"
        print(f"{r['label']:<24}{paper:>7}{100 * r['goodput']:>8.1f}%{100 * r['uptime']:>8.2f}%"
              f"{r['num_failures']:>10}{r['horizon_days']:>10.1f}{r['wall_s']:>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scales", nargs="*", default=["100000:0.5", "100000:2"],
                        help="extra columns as CHIPS:MTBI_YEARS")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write every result to this JSON file")
    args = parser.parse_args()

    columns = [(PAPER_CHIPS, PAPER_MTBI_YEARS)] + [
        (int(s.split(":")[0]), float(s.split(":")[1])) for s in args.scales]
    results = []
    for chips, mtbi_years in columns:
        rows = run_column(chips=chips, mtbi_years=mtbi_years, seed=args.seed)
        print_column(rows, chips=chips, mtbi_years=mtbi_years)
        results.extend(rows)
    calib = [r for r in results if r["paper_goodput"] is not None]
    worst = max(abs(100 * r["goodput"] - r["paper_goodput"]) for r in calib)
    print(f"\nlargest gap to the paper at 1.2M chips / 1 year: {worst:.1f} goodput points")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seed": args.seed, "max_abs_gap_points": worst, "results": results}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
