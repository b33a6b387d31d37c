"""The built-in Hugging Face task and `ddiloco export --hf-dir`."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ddiloco_cli.errors import UsageError  # noqa: E402
from ddiloco_cli.protocol.published import read_global_params  # noqa: E402
from ddiloco_cli.tasks import load_task  # noqa: E402

from support.built_run import build_run, invoke  # noqa: E402

TINY_LLAMA = ("ddiloco_cli.tasks.hf:causal_lm?config=llama&hidden_size=32&intermediate_size=64"
              "&num_hidden_layers=2&num_attention_heads=4&num_key_value_heads=2&seq_len=32")
TINY_GPT2 = "ddiloco_cli.tasks.hf:causal_lm?config=gpt2&n_embd=32&n_layer=1&n_head=2&n_positions=64&seq_len=16"


def test_task_arguments_come_from_the_spec():
    task = load_task(TINY_LLAMA)
    assert task.config.model_type == "llama"
    assert (task.config.hidden_size, task.config.num_hidden_layers, task.seq_len) == (32, 2, 32)
    assert task.config.vocab_size == 256, "byte-level tokenizer"
    with pytest.raises(UsageError, match="no_such_type"):
        load_task("ddiloco_cli.tasks.hf:causal_lm?config=no_such_type")
    with pytest.raises(UsageError, match="callable with the arguments given"):
        load_task("ddiloco_cli.tasks.gpt:GPTTask?bogus=1")
    with pytest.raises(UsageError, match="not a class or function"):
        load_task("ddiloco_cli.tasks.gpt:tiny?seq_len=3")
    with pytest.raises(UsageError, match="does not exist on this machine"):
        load_task("ddiloco_cli.tasks.hf:causal_lm?config=/nonexistent/config.json")


def test_causal_lm_trains_and_evaluates_offline():
    task = load_task(TINY_GPT2)
    model = task.build_model()
    x, y = next(task.batches(shard=0, num_shards=2, seed=1, batch_size=4))
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    loss = task.loss(model, (x, y))
    assert torch.isfinite(loss) and abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 1.0
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    first = [b[0] for b in task.val_batches(batch_size=8)]
    again = [b[0] for b in task.val_batches(batch_size=8)]
    assert len(first) > 1 and all(torch.equal(a, b) for a, b in zip(first, again))
    assert task.decode(task.encode("to be, or not")) == "to be, or not"


def test_export_hf_dir_loads_with_from_pretrained(tmp_path):
    built = build_run(str(tmp_path / "run"), rounds=2, num_fragments=3, task=TINY_LLAMA)
    out = tmp_path / "hf" / "model"
    result = invoke("export", built.url, "--hf-dir", str(out))
    assert result.exit_code == 0, result.output
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    params, versions = read_global_params(built.store, run_id=built.run["run_id"], plan=built.plan)
    assert versions == {p: 2 for p in range(3)}
    named = dict(loaded.named_parameters())
    assert set(named) == set(params)
    for name, value in params.items():
        assert torch.equal(named[name].detach(), value), name
    x = torch.arange(8).unsqueeze(0)
    assert loaded(input_ids=x).logits.shape == (1, 8, 256)


def test_export_hf_dir_refuses_a_model_that_is_not_transformers(tmp_path):
    built = build_run(str(tmp_path / "run"), rounds=1)
    result = invoke("export", built.url, "--hf-dir", str(tmp_path / "hf"))
    assert result.exit_code == 2 and "not a transformers model" in result.output, result.output
    assert not (tmp_path / "hf").exists()


def test_export_hf_dir_has_tokenizer_card_and_pushes_to_a_local_hub(tmp_path, monkeypatch):
    from ddiloco_cli.ops.metrics import MetricsWriter

    built = build_run(str(tmp_path / "run"), rounds=1, num_fragments=2, task=TINY_LLAMA)
    w = MetricsWriter(built.store, role="syncer", writer_id="s", flush_every_s=3600)
    w.log(step=2, global_val_loss=4.25)  # what `sync --eval-every` records
    w.close()
    out, hub = tmp_path / "hf", tmp_path / "hub"
    monkeypatch.setenv("DDILOCO_HUB_DIR", str(hub))
    result = invoke("export", built.url, "--hf-dir", str(out), "--push-to-hub", "me/tiny")
    assert result.exit_code == 0, result.output
    for where in (out, hub / "me" / "tiny"):
        tok = transformers.AutoTokenizer.from_pretrained(str(where))
        text = "to be, or not ü"
        assert tok(text)["input_ids"] == list(text.encode()), "token id = UTF-8 byte, no special tokens"
        assert tok.decode(list(text.encode())) == text
        card = (where / "README.md").read_text()
        assert built.run["run_id"] in card and "| num_fragments | `2` |" in card
        assert "Final validation loss of the global model: 4.2500 (syncer evaluation at merge 2)" in card
        assert transformers.AutoModelForCausalLM.from_pretrained(str(where)).config.vocab_size == 256
    refused = invoke("export", built.url, str(tmp_path / "m.safetensors"), "--push-to-hub", "me/tiny")
    assert refused.exit_code == 2 and "--hf-dir" in refused.output


def test_llama_derived_sizes_scale_with_hidden_size():
    small = load_task("ddiloco_cli.tasks.hf:causal_lm?config=llama&hidden_size=64&num_hidden_layers=2"
                      "&num_attention_heads=4").config
    assert small.intermediate_size == round(11008 * 64 / 4096)
    given = load_task("ddiloco_cli.tasks.hf:causal_lm?config=llama&hidden_size=64&intermediate_size=100"
                      "&num_attention_heads=4").config
    assert given.intermediate_size == 100, "a size given is kept"
