"""Codec benchmark: bytes per parameter, relative error and throughput per codec.

Sizes and errors are measured on real outer gradients: a small char-level GPT
(defined below, ~0.8M parameters) is trained with AdamW on real English text
(ddiloco_cli/data/shakespeare_excerpt.txt, shipped with the package) for
--warmup-steps, then for H = --sync-every more steps; the outer gradient is
theta_before - theta_after. "down" is the syncer's published delta after one
Nesterov outer step on that gradient (encode_published_delta). Throughput is
measured on one core (torch.set_num_threads(1)) over --numel values tiled from
the real outer gradient.

    .venv/bin/python scripts/bench_codec.py                      # ~100M values for throughput
    .venv/bin/python scripts/bench_codec.py --numel 4000000 --json /tmp/codec.json   # CPU/CI-sized
    .venv/bin/python scripts/bench_codec.py --codecs int4 --blocks 64,128,256 --numel 4000000
    .venv/bin/python scripts/bench_codec.py --codecs int4,sparse --numel 4000000 --density 0.02
    .venv/bin/python scripts/bench_codec.py --codecs int4,sparse --numel 4000000 --chunks 1024,4096
    .venv/bin/python scripts/bench_codec.py --kernels --codecs int4,int8 --numel 4000000   # compiled vs numpy

--kernels: the learner's and the syncer's calls, each with the compiled kernels
(ddiloco_cli/numerics/_native.c) and with the numpy passes, in turns in one process: encode
with residual (a learner's contribution), a published delta added to the previous value (a
receiver), a contribution decoded from its codes (the syncer), on one fragment of the real
outer gradient (its tensors as the model has them) and on --numel values.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ddiloco_cli.numerics import native
from ddiloco_cli.numerics.codec import (
    CODECS,
    DEFAULT_BLOCK_SIZE,
    apply_published_delta,
    decode_tensors,
    encode_published_delta,
    encode_tensors,
    encode_with_residual,
)
from ddiloco_cli.numerics.outer import OuterOptimizer

REPO = Path(__file__).resolve().parent.parent
TEXT_PATH = REPO / "ddiloco_cli/data/shakespeare_excerpt.txt"


# --- a tiny char-level GPT ----------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self, d: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.ln_1 = torch.nn.LayerNorm(d)
        self.c_attn = torch.nn.Linear(d, 3 * d)
        self.c_proj = torch.nn.Linear(d, d)
        self.ln_2 = torch.nn.LayerNorm(d)
        self.mlp_fc = torch.nn.Linear(d, 4 * d)
        self.mlp_proj = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.num_heads, C // self.num_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.mlp_fc(self.ln_2(x))))


class CharGPT(torch.nn.Module):
    def __init__(self, vocab: int, *, d: int = 128, num_layers: int = 4, num_heads: int = 4, context: int = 64):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, d)
        self.wpe = torch.nn.Embedding(context, d)
        self.blocks = torch.nn.ModuleList(Block(d, num_heads) for _ in range(num_layers))
        self.ln_f = torch.nn.LayerNorm(d)
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def load_text() -> tuple[str, Path]:
    return TEXT_PATH.read_text(encoding="utf-8"), TEXT_PATH


def real_outer_gradient(
    *, sync_every: int = 24, warmup_steps: int = 100, batch_size: int = 16, context: int = 64, seed: int = 0
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """(theta_before, outer gradient theta_before - theta_after H AdamW steps, info)."""
    text, path = load_text()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = CharGPT(len(chars), context=context)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)

    def train(num_steps):
        loss = None
        for _ in range(num_steps):
            ix = torch.randint(len(data) - context - 1, (batch_size,), generator=g)
            x = torch.stack([data[i : i + context] for i in ix])
            y = torch.stack([data[i + 1 : i + 1 + context] for i in ix])
            loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return float(loss.detach())

    loss_warm = train(warmup_steps)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    loss_after = train(sync_every)
    grad = {k: before[k] - v.detach() for k, v in model.named_parameters()}
    info = {
        "text": str(path.relative_to(REPO) if path.is_relative_to(REPO) else path),
        "num_params": sum(v.numel() for v in grad.values()),
        "warmup_steps": warmup_steps,
        "sync_every": sync_every,
        "loss_after_warmup": round(loss_warm, 4),
        "loss_after_sync_window": round(loss_after, 4),
    }
    return before, grad, info


def rel_error(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> float:
    num = math.sqrt(sum(float((x[k] - y[k]).pow(2).sum()) for k in x))
    den = math.sqrt(sum(float(x[k].pow(2).sum()) for k in x))
    return num / den


def measure_sizes(codec: str, block_size: int | None, before, grad, *, density: float | None = None) -> dict:
    """Bytes/param and relative error of the upload (outer gradient) and of the
    download (published delta after one outer step) for one codec."""
    numel = sum(v.numel() for v in grad.values())
    up = encode_tensors(grad, codec=codec, block_size=block_size, density=density)
    dec, _ = decode_tensors(up)
    # syncer side: global = before; one Nesterov outer step on the (merged) outer gradient
    new_global = {k: v.clone() for k, v in before.items()}
    OuterOptimizer(lr=0.7, momentum=0.9).step(new_global, grad)
    down, published = encode_published_delta(before, new_global, codec=codec, block_size=block_size, density=density)
    true_step = {k: before[k] - new_global[k] for k in before}
    pub_step = {k: before[k] - published[k] for k in before}
    return {
        "up_bytes_per_param": len(up) / numel,
        "up_rel_error": rel_error(grad, dec),
        "down_bytes_per_param": len(down) / numel,
        "down_rel_error": rel_error(true_step, pub_step),
    }


def measure_throughput(configs: list[tuple[str, int | None, float | None]], grad, *, numel: int,
                       repeats: int) -> list[dict]:
    """Encode and decode throughput of each (codec, block, density), best of ``repeats``; the
    configurations take turns within each repeat, so a slow spell of the host falls on all of
    them and the ratios between them hold."""
    flat = torch.cat([v.flatten() for v in grad.values()])
    x = {"x": flat.repeat(-(-numel // flat.numel()))[:numel].contiguous()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    enc_s = [float("inf")] * len(configs)
    dec_s = [float("inf")] * len(configs)
    try:
        for _ in range(repeats):
            for i, (codec, block_size, density) in enumerate(configs):
                t0 = time.perf_counter()
                data = encode_tensors(x, codec=codec, block_size=block_size, density=density)
                t1 = time.perf_counter()
                decode_tensors(data, max_numel=numel)
                t2 = time.perf_counter()
                enc_s[i], dec_s[i] = min(enc_s[i], t1 - t0), min(dec_s[i], t2 - t1)
    finally:
        torch.set_num_threads(threads)
    mb = 4 * numel / 1e6
    return [{"encode_MBps": mb / e, "decode_MBps": mb / d, "roundtrip_MBps": mb / (e + d)}
            for e, d in zip(enc_s, dec_s)]


def measure_kernels(codec: str, tensors: dict[str, torch.Tensor], *, repeats: int) -> dict:
    """ms per call of the learner's, the receiver's and the syncer's codec calls on ``tensors``,
    with the compiled kernels and with the numpy passes (best of ``repeats``, in turns), and
    whether both made the same bytes."""
    kernels = native.kernels
    prev = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(1)) for k, v in tensors.items()}
    payload = encode_tensors(tensors, codec=codec)
    calls = {
        "encode_with_residual": lambda: encode_with_residual(tensors, codec=codec),
        "apply_published_delta": lambda: apply_published_delta(prev, payload, where="bench"),
        "decode_from_codes": lambda: [decode_tensors(payload, keep_codes=True)[0][k] for k in tensors],
    }
    best = {(name, arm): float("inf") for name in calls for arm in ("compiled", "numpy")}
    outputs = {}
    torch.set_num_threads(1)
    try:
        for _ in range(repeats):
            for arm, k in (("compiled", kernels), ("numpy", None)):
                native.kernels = k
                for name, call in calls.items():
                    t0 = time.perf_counter()
                    out = call()
                    best[name, arm] = min(best[name, arm], time.perf_counter() - t0)
                    outputs[name, arm] = out
    finally:
        native.kernels = kernels

    def same(a, b) -> bool:
        if isinstance(a, tuple):  # (payload, residual)
            return a[0] == b[0] and same(a[1], b[1])
        pairs = zip(a.values(), b.values()) if isinstance(a, dict) else zip(a, b)
        return all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in pairs)

    numel = sum(t.numel() for t in tensors.values())
    return {name: {"numel": numel, "tensors": len(tensors), "compiled_ms": 1e3 * best[name, "compiled"],
                   "numpy_ms": 1e3 * best[name, "numpy"], "speedup": best[name, "numpy"] / best[name, "compiled"],
                   "same_bytes": same(outputs[name, "compiled"], outputs[name, "numpy"])} for name in calls}


def print_kernels(codec: str, label: str, result: dict) -> None:
    for name, r in result.items():
        print(f"{codec:<6}{label:<42}{name:<24}{r['compiled_ms']:>10.3f}{r['numpy_ms']:>10.3f}{r['speedup']:>9.2f}x"
              f"{'yes' if r['same_bytes'] else 'NO':>7}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=100_000_000, help="values for the throughput test")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sync-every", type=int, default=24, help="H: AdamW steps in the outer gradient")
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument("--blocks", default=None,
                    help="comma-separated block sizes for the block codecs (int8, int4); default: each codec's own")
    ap.add_argument("--density", type=float, default=None, help="sparse: values sent per chunk (default 0.02)")
    ap.add_argument("--chunks", default=None,
                    help="comma-separated chunk sizes for sparse; default: the codec's own")
    ap.add_argument("--kernels", action="store_true",
                    help="only the compiled kernels against the numpy passes (int4/int8 among --codecs)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    before, grad, info = real_outer_gradient(sync_every=args.sync_every, warmup_steps=args.warmup_steps)
    if args.kernels:
        if native.kernels is None:
            raise SystemExit(native.describe())
        keys = list(grad)
        fragment = {k: grad[k] for k in keys[len(keys) // 3 : len(keys) // 3 + 4]}  # a few tensors, as a fragment
        flat = torch.cat([v.flatten() for v in grad.values()])
        big = {"x": flat.repeat(-(-args.numel // flat.numel()))[: args.numel].contiguous()}
        print(f"compiled kernels vs numpy passes, 1 thread, best of {args.repeats} (arms in turn); ms per call")
        print(f"{'codec':<6}{'tensors':<42}{'call':<24}{'compiled':>10}{'numpy':>10}{'speedup':>10}{'same':>7}")
        results = {}
        for codec in [c for c in args.codecs.split(",") if c in ("int4", "int8")]:
            for label, tensors in ((f"fragment: {len(fragment)} tensors, "
                                    f"{sum(v.numel() for v in fragment.values()):,} values", fragment),
                                   (f"one tensor of {args.numel:,} values", big)):
                results[f"{codec} {label}"] = r = measure_kernels(codec, tensors, repeats=max(args.repeats, 5))
                print_kernels(codec, label, r)
        if args.json:
            args.json.write_text(json.dumps({"info": info, "kernels": results}, indent=1) + "\n")
        return
    configs = []
    for codec in args.codecs.split(","):
        blocks = [DEFAULT_BLOCK_SIZE.get(codec)]
        if args.blocks and codec in ("int8", "int4"):
            blocks = [int(b) for b in args.blocks.split(",")]
        if args.chunks and codec == "sparse":
            blocks = [int(b) for b in args.chunks.split(",")]
        configs += [(codec, block, args.density if codec == "sparse" else None) for block in blocks]
    rows = []
    for codec, block, density in configs:
        row = {"codec": codec, "block_size": block, **({"density": density or 0.02} if codec == "sparse" else {})}
        row.update(measure_sizes(codec, block, before, grad, density=density))
        rows.append(row)
    for row, speed in zip(rows, measure_throughput(configs, grad, numel=args.numel, repeats=args.repeats)):
        row.update(speed)
    # encode time per value against int4 at its default block (the learner's default codec)
    base = next((r for r in rows if r["codec"] == "int4" and r["block_size"] == DEFAULT_BLOCK_SIZE["int4"]), None)
    for r in rows:
        r["encode_time_vs_int4"] = base["encode_MBps"] / r["encode_MBps"] if base else None

    print(f"outer gradient: {info['num_params']:,} params, H={info['sync_every']} AdamW steps after "
          f"{info['warmup_steps']} warmup, text {info['text']} (loss {info['loss_after_sync_window']})")
    print(f"throughput: {args.numel:,} fp32 values, 1 thread, best of {args.repeats} (codecs in turn)")
    hdr = f"{'codec':<6}{'block':>6}{'up B/param':>12}{'up rel.err':>12}{'down B/param':>14}" \
          f"{'down rel.err':>14}{'enc MB/s':>10}{'dec MB/s':>10}{'enc+dec MB/s':>14}{'enc time/int4':>15}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['codec']:<6}{str(r['block_size'] or '-'):>6}{r['up_bytes_per_param']:>12.4f}"
              f"{r['up_rel_error']:>12.4%}{r['down_bytes_per_param']:>14.4f}{r['down_rel_error']:>14.4%}"
              f"{r['encode_MBps']:>10.0f}{r['decode_MBps']:>10.0f}{r['roundtrip_MBps']:>14.0f}"
              + (f"{r['encode_time_vs_int4']:>14.2f}x" if r["encode_time_vs_int4"] else f"{'-':>15}"))
    if args.json:
        args.json.write_text(json.dumps({"info": info, "numel": args.numel, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
