"""Merging sparse contributions: RDA against the weighted mean, on real outer gradients.

M learners start from one warmed-up char-level GPT (bench_codec.py's model and text) and
each trains H AdamW steps on its own batches; their outer gradients are encoded with a
codec (sparse at --density, or int4 for reference), decoded as the syncer decodes them, and
merged by ``merge.merge_outer_gradients`` with method "mean" and "rda" (on sparse inputs:
the union of the supports). Each merge is compared with the mean of the exact gradients:
cosine similarity and norm ratio (the merged norm / the exact mean's norm), and timed.

With mostly disjoint supports the mean of M sparse vectors is about 1/sqrt(M) as long as
one of them, while RDA keeps the mean norm of the contributions: this measures how much
longer RDA's step is than the mean's, and whether its direction is any better.

    .venv/bin/python scripts/bench_sparse_merge.py                    # M = 2, 4, 8
    .venv/bin/python scripts/bench_sparse_merge.py --ms 4 --density 0.01 --json /tmp/merge.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time

import torch
from bench_codec import CharGPT, load_text

from ddiloco_cli.numerics.codec import decode_tensors, encode_tensors
from ddiloco_cli.numerics.merge import is_embedding_key, merge_outer_gradients


def outer_gradients(m: int, *, warmup: int, h: int, batch: int = 16, context: int = 64, seed: int = 0):
    """M outer gradients of H AdamW steps each from one warmed-up model, on different batches."""
    text, _ = load_text()
    chars = sorted(set(text))
    data = torch.tensor([{c: i for i, c in enumerate(chars)}[c] for c in text], dtype=torch.long)
    torch.manual_seed(seed)
    model = CharGPT(len(chars), context=context)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)

    def train(mod, optim, steps, gen):
        for _ in range(steps):
            ix = torch.randint(len(data) - context - 1, (batch,), generator=gen)
            x = torch.stack([data[i : i + context] for i in ix])
            y = torch.stack([data[i + 1 : i + 1 + context] for i in ix])
            loss = mod(x, y)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()

    train(model, opt, warmup, torch.Generator().manual_seed(seed))
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    grads = []
    for i in range(m):
        mod, o = copy.deepcopy(model), None
        o = torch.optim.AdamW(mod.parameters(), lr=3e-3, weight_decay=0.1)
        o.load_state_dict(opt.state_dict())
        train(mod, o, h, torch.Generator().manual_seed(seed + 1 + i))
        grads.append({k: before[k] - v.detach() for k, v in mod.named_parameters()})
    return grads


def compare(merged: dict, exact: dict) -> dict:
    dot = sum(float((merged[k] * exact[k]).sum()) for k in exact)
    nm = math.sqrt(sum(float(merged[k].pow(2).sum()) for k in exact))
    ne = math.sqrt(sum(float(exact[k].pow(2).sum()) for k in exact))
    return {"cosine": dot / (nm * ne) if nm and ne else 0.0, "norm_ratio": nm / ne}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="2,4,8", help="learners per merge")
    ap.add_argument("--density", type=float, default=0.02)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--sync-every", type=int, default=24, help="H")
    ap.add_argument("--repeats", type=int, default=3, help="timed merges (best of)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for m in (int(x) for x in args.ms.split(",")):
        grads = outer_gradients(m, warmup=args.warmup_steps, h=args.sync_every)
        weights = [1.0] * m
        exact = {k: sum(g[k] for g in grads) / m for k in grads[0]}
        mean_keys = {k for k in grads[0] if is_embedding_key(k)}
        for codec in ("int4", "sparse"):
            decoded = [decode_tensors(encode_tensors(g, codec=codec, density=args.density), max_numel=1 << 24,
                                      keep_codes=True)[0] for g in grads]
            for method in ("mean", "rda"):
                best = math.inf
                for _ in range(args.repeats):
                    t0 = time.process_time()
                    merged = merge_outer_gradients(decoded, weights, method=method, mean_keys=mean_keys)
                    best = min(best, time.process_time() - t0)
                numel = sum(t.numel() for t in merged.values())
                rows.append({"m": m, "codec": codec, "method": method, **compare(merged, exact),
                             "cpu_ms": best * 1e3, "param_contribs_per_cpu_s": numel * m / best if best else math.inf})
    print(f"real outer gradients (char GPT, H={args.sync_every} after {args.warmup_steps} warmup), sparse density "
          f"{args.density}; against the mean of the exact gradients")
    print(f"{'M':>3} {'codec':<7}{'merge':<6}{'cosine':>8}{'norm ratio':>12}{'CPU ms':>9}{'p-c/CPU-s':>12}")
    for r in rows:
        print(f"{r['m']:>3} {r['codec']:<7}{r['method']:<6}{r['cosine']:>8.3f}{r['norm_ratio']:>12.3f}"
              f"{r['cpu_ms']:>9.1f}{r['param_contribs_per_cpu_s']:>12.3g}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"settings": vars(args), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
