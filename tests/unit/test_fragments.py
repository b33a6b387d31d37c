"""Balanced fragmentation: determinism, coverage, balance, plan validation, gather/scatter."""

import pytest
import torch

from ddiloco_cli.errors import ProtocolError, UsageError
from ddiloco_cli.protocol.fragments import (
    FragmentPlan,
    gather_fragment,
    named_shapes_of,
    plan_fragments,
    scatter_fragment,
)


def gpt2_small_shapes():
    """GPT-2 small (124M, tied embeddings: lm_head shares wte)."""
    f = "float32"
    s = {"wte.weight": ((50257, 768), f), "wpe.weight": ((1024, 768), f)}
    for i in range(12):
        b = f"h.{i}."
        s[b + "ln_1.weight"] = ((768,), f)
        s[b + "ln_1.bias"] = ((768,), f)
        s[b + "attn.c_attn.weight"] = ((768, 2304), f)
        s[b + "attn.c_attn.bias"] = ((2304,), f)
        s[b + "attn.c_proj.weight"] = ((768, 768), f)
        s[b + "attn.c_proj.bias"] = ((768,), f)
        s[b + "ln_2.weight"] = ((768,), f)
        s[b + "ln_2.bias"] = ((768,), f)
        s[b + "mlp.c_fc.weight"] = ((768, 3072), f)
        s[b + "mlp.c_fc.bias"] = ((3072,), f)
        s[b + "mlp.c_proj.weight"] = ((3072, 768), f)
        s[b + "mlp.c_proj.bias"] = ((768,), f)
    s["ln_f.weight"] = ((768,), f)
    s["ln_f.bias"] = ((768,), f)
    return s


def llama_1b_shapes(num_kv_heads=32):
    """Llama-like ~1B: vocab 32000, d 2048, 16 layers, ffn 5632, untied head."""
    f, d, hd = "float32", 2048, 64
    s = {"embed_tokens.weight": ((32000, d), f)}
    for i in range(16):
        b = f"layers.{i}."
        s[b + "q_proj.weight"] = ((d, d), f)
        s[b + "k_proj.weight"] = ((num_kv_heads * hd, d), f)
        s[b + "v_proj.weight"] = ((num_kv_heads * hd, d), f)
        s[b + "o_proj.weight"] = ((d, d), f)
        s[b + "gate_proj.weight"] = ((5632, d), f)
        s[b + "up_proj.weight"] = ((5632, d), f)
        s[b + "down_proj.weight"] = ((d, 5632), f)
        s[b + "input_layernorm.weight"] = ((d,), f)
        s[b + "post_attention_layernorm.weight"] = ((d,), f)
    s["norm.weight"] = ((d,), f)
    s["lm_head.weight"] = ((32000, d), f)
    return s


def imbalance(plan):
    ideal = plan.total_numel() / plan.num_fragments
    return max(plan.fragment_numel(p) for p in range(plan.num_fragments)) / ideal


# Largest fragment / ideal measured with this planner (see the report); the test
# pins them so a regression in balance shows up.
MEASURED = {
    ("gpt2", 8): 1.0167, ("gpt2", 24): 1.1376, ("gpt2", 64): 1.2134,
    ("llama", 8): 1.0208, ("llama", 24): 1.0362, ("llama", 64): 1.0560,
    ("llama-gqa", 8): 1.0037, ("llama-gqa", 24): 1.0238, ("llama-gqa", 64): 1.2044,
}
MODELS = {"gpt2": gpt2_small_shapes, "llama": llama_1b_shapes, "llama-gqa": lambda: llama_1b_shapes(4)}


@pytest.mark.parametrize("model,num_fragments", sorted(MEASURED))
def test_balance_on_real_model_shapes(model, num_fragments):
    shapes = MODELS[model]()
    plan = plan_fragments(shapes, num_fragments)
    assert plan.total_numel() == sum(torch.Size(s).numel() for s, _ in shapes.values())
    ratio = imbalance(plan)
    if num_fragments == 24:
        assert ratio <= 4 / 3
    assert ratio <= MEASURED[(model, num_fragments)] + 1e-4
    # every fragment non-empty
    assert all(plan.fragments[p] for p in range(num_fragments))


def test_without_row_split_gpt2_is_dominated_by_wte():
    plan = plan_fragments(gpt2_small_shapes(), 24, split_rows=False)
    assert imbalance(plan) > 7  # wte alone is 31% of the model: splitting matters


def test_every_row_covered_exactly_once_and_deterministic():
    shapes = gpt2_small_shapes()
    plan = plan_fragments(shapes, 24)
    assert plan == plan_fragments(dict(shapes), 24)
    rows = {}
    for frag in plan.fragments:
        for s in frag:
            rows.setdefault(s.name, []).append((s.row_start, s.row_end))
    assert set(rows) == set(shapes)
    for name, ranges in rows.items():
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == shapes[name][0][0]
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    keys = [s.key for f in plan.fragments for s in f]
    assert len(keys) == len(set(keys))
    assert any("[" in k for k in keys) and "wpe.weight" in keys


def test_json_round_trip_and_validation():
    plan = plan_fragments(gpt2_small_shapes(), 8)
    import json

    assert FragmentPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    bad = plan.to_json()
    bad["fragments"][0][0]["row_end"] += 1  # overlaps the next slice / exceeds rows
    with pytest.raises(ProtocolError):
        FragmentPlan.from_json(bad)
    bad = plan.to_json()
    bad["fragments"][1].extend(bad["fragments"][0])  # duplicated rows
    with pytest.raises(ProtocolError, match="overlap"):
        FragmentPlan.from_json(bad)
    bad = plan.to_json()
    bad["num_fragments"] = 9
    with pytest.raises(ProtocolError):
        FragmentPlan.from_json(bad)
    bad = plan.to_json()
    bad["format"] = 99
    with pytest.raises(ProtocolError, match="upgrade"):
        FragmentPlan.from_json(bad)
    with pytest.raises(ProtocolError):
        FragmentPlan.from_json([1, 2])


def test_too_many_fragments_is_a_usage_error():
    shapes = {"a": ((3,), "float32"), "b": ((2,), "float32")}
    assert plan_fragments(shapes, 2).num_fragments == 2
    with pytest.raises(UsageError, match="--fragments 6 too large"):
        plan_fragments(shapes, 6)


class Tiny(torch.nn.Module):
    def __init__(self, d=5):
        super().__init__()
        self.emb = torch.nn.Embedding(40, d)
        self.lin = torch.nn.Linear(d, 7)
        self.norm = torch.nn.LayerNorm(7)
        self.scalar = torch.nn.Parameter(torch.tensor(0.5))


def test_check_model_names_the_mismatching_tensor():
    plan = plan_fragments(named_shapes_of(Tiny()), 3)
    plan.check_model(dict(Tiny().named_parameters()))
    plan.check_model(named_shapes_of(Tiny()))
    with pytest.raises(UsageError, match="'emb.weight' has shape"):
        plan.check_model(dict(Tiny(d=6).named_parameters()))
    params = dict(Tiny().named_parameters())
    del params["norm.bias"]
    with pytest.raises(UsageError, match="'norm.bias' of the run is missing") as exc:
        plan.check_model(params)
    assert "--model" not in str(exc.value) and "ddiloco init --task" in str(exc.value)  # flags that exist
    params = dict(Tiny().named_parameters())
    params["extra"] = torch.zeros(2)
    with pytest.raises(UsageError, match="'extra'"):
        plan.check_model(params)
    with pytest.raises(UsageError, match="dtype bfloat16"):
        plan.check_model(dict(Tiny().to(torch.bfloat16).named_parameters()))


def test_gather_scatter_round_trip_with_row_slices():
    torch.manual_seed(0)
    model = Tiny()
    plan = plan_fragments(named_shapes_of(model), 4)
    assert any(not s.is_whole for f in plan.fragments for s in f)  # emb is split
    params = dict(model.named_parameters())
    before = {k: v.detach().clone() for k, v in params.items()}
    parts = [gather_fragment(plan, p, params) for p in range(4)]
    for p, part in enumerate(parts):
        assert set(part) == set(plan.fragment_shapes(p))
        for k, v in part.items():
            assert v.dtype == torch.float32 and tuple(v.shape) == plan.fragment_shapes(p)[k]
    # gather returns copies: changing them does not touch the model
    parts[0][next(iter(parts[0]))].add_(1)
    assert all(torch.equal(before[k], v) for k, v in params.items())
    # scatter writes exactly fragment 1's slices, in place, under no_grad
    new = {k: torch.full_like(v, 3.0) for k, v in parts[1].items()}
    scatter_fragment(plan, 1, params, new)
    for s in plan.fragments[1]:
        assert torch.all(s.view_of(params[s.name]) == 3.0)
    for p in (0, 2, 3):
        for s in plan.fragments[p]:
            assert torch.equal(s.view_of(params[s.name]), s.view_of(before[s.name]))
    # and casts to the parameter dtype
    bf = {k: v.detach().to(torch.bfloat16) for k, v in params.items()}
    scatter_fragment(plan, 2, bf, gather_fragment(plan, 2, params))
    assert all(v.dtype == torch.bfloat16 for v in bf.values())
