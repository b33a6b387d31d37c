"""Bandwidth model: bytes per learner per inner step, Decoupled DiLoCo vs data-parallel.

Data-parallel: a ring all-reduce of fp32 gradients every step (reduce-scatter,
then all-gather) makes every worker send 2 (n-1)/n * 4 bytes * params and
receive as much (n = --learners data centres); both directions are counted, as
they are for Decoupled DiLoCo (up + down).
Decoupled DiLoCo: every parameter goes up once per H steps (as part of one of P
fragments) and comes back down once per H steps, so per step a learner sends
params * b_up / H and receives params * b_down / H, where b = encoded bytes per
parameter *measured* on a real outer gradient (the small char-level GPT of
bench_codec.py trained H AdamW steps on real text; "down" is the syncer's
published delta with error feedback) and scaled to --params. P does not change
the average, only the peak: one fragment is params / P.

The paper's 8-data-centre figure (data-parallel ~198 Gbps vs ~0.84 Gbps, ~236x)
is recomputed with our ratio: 198 Gbps / ratio (same step time and model).

    .venv/bin/python scripts/bench_bandwidth.py --json /tmp/bw.json                 # P=H=24, int4, 1B
    .venv/bin/python scripts/bench_bandwidth.py --sync-every 100 --fragments 24 --json /tmp/bw100.json
    .venv/bin/python scripts/bench_bandwidth.py --warmup-steps 20 --sync-every 8   # CPU-sized smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_codec import measure_sizes, real_outer_gradient  # noqa: E402

from ddiloco_cli.numerics.codec import CODECS, DEFAULT_BLOCK_SIZE  # noqa: E402

PAPER_DP_GBPS = 198.0
PAPER_DDILOCO_GBPS = 0.84


def dp_bytes_per_step(params: float, learners: int) -> float:
    """Bytes one worker sends (and, again, receives) per step in a ring all-reduce."""
    return 2 * (learners - 1) / learners * 4 * params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fragments", type=int, default=24, help="P")
    ap.add_argument("--sync-every", type=int, default=24, help="H")
    ap.add_argument("--codec", default="int4", choices=CODECS, help="upload codec")
    ap.add_argument("--down-codec", default=None, choices=CODECS, help="download codec (default: --codec)")
    ap.add_argument("--params", type=float, default=1e9, help="model size to scale to")
    ap.add_argument("--learners", type=int, default=8, help="data centres (ring size for data-parallel)")
    ap.add_argument("--step-time-s", type=float, default=None, help="also print absolute Gbps at this step time")
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    down_codec = args.down_codec or args.codec
    H, P, N = args.sync_every, args.fragments, args.params

    before, grad, info = real_outer_gradient(sync_every=H, warmup_steps=args.warmup_steps)
    measured = {c: measure_sizes(c, DEFAULT_BLOCK_SIZE.get(c), before, grad) for c in CODECS}

    dp = dp_bytes_per_step(N, args.learners)
    rows = [{"setting": f"data-parallel fp32 ring all-reduce (n={args.learners})", "up": dp, "down": dp,
             "peak": 2 * dp, "ratio": 1.0}]
    for up_c, down_c in [(c, c) for c in CODECS] + ([(args.codec, down_codec)] if down_codec != args.codec else []):
        b_up = measured[up_c]["up_bytes_per_param"]
        b_down = measured[down_c]["down_bytes_per_param"]
        up, down = N * b_up / H, N * b_down / H
        rows.append({
            "setting": f"DDiLoCo P={P} H={H} up {up_c} / down {down_c}",
            "up_codec": up_c, "down_codec": down_c,
            "b_up": b_up, "b_down": b_down,
            "up": up, "down": down,
            "peak": N / P * (b_up + b_down),  # one fragment up and one down at a sync step
            "ratio": 2 * dp / (up + down),
        })
    main_row = next(r for r in rows[1:] if r["up_codec"] == args.codec and r["down_codec"] == down_codec)
    ratio = main_row["ratio"]

    print(f"model {N:.3g} params; measured bytes/param on a {info['num_params']:,}-param char GPT outer "
          f"gradient (H={H} AdamW steps, {info['text']})")
    hdr = f"{'setting':<52}{'up MB/step':>12}{'down MB/step':>14}{'peak MB':>10}{'vs DP':>9}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['setting']:<52}{r['up'] / 1e6:>12.1f}{r['down'] / 1e6:>14.1f}{r['peak'] / 1e6:>10.1f}"
              f"{r['ratio']:>8.0f}x")
    ours_gbps = PAPER_DP_GBPS / ratio
    print(f"\npaper, 8 data centres: DP {PAPER_DP_GBPS} Gbps vs DDiLoCo {PAPER_DDILOCO_GBPS} Gbps "
          f"({PAPER_DP_GBPS / PAPER_DDILOCO_GBPS:.0f}x)")
    print(f"recomputed with P={P} H={H} {args.codec}/{down_codec}: DP {PAPER_DP_GBPS} Gbps vs "
          f"{ours_gbps:.3f} Gbps ({ratio:.0f}x)")
    result = {
        "config": {"fragments": P, "sync_every": H, "codec": args.codec, "down_codec": down_codec,
                   "params": N, "learners": args.learners},
        "measured_on": info,
        "bytes_per_param": measured,
        "rows": rows,
        "ratio_vs_data_parallel": ratio,
        "paper_dp_gbps": PAPER_DP_GBPS,
        "recomputed_ddiloco_gbps": ours_gbps,
    }
    if args.step_time_s:
        gbps = (main_row["up"] + main_row["down"]) * 8 / args.step_time_s / 1e9
        dp_gbps = 2 * dp * 8 / args.step_time_s / 1e9
        print(f"at {args.step_time_s} s/step: DP {dp_gbps:.2f} Gbps vs DDiLoCo {gbps:.4f} Gbps")
        result.update(step_time_s=args.step_time_s, dp_gbps=dp_gbps, ddiloco_gbps=gbps)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
