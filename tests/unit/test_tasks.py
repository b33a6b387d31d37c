"""The task interface (load_task, evaluate, to_device) and the built-in char GPT on Shakespeare
(the token files under concurrent processes: tests/integration/test_tasks_processes.py)."""

import json
import math
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from ddiloco_cli.errors import UsageError
from ddiloco_cli.tasks import evaluate, load_task, move_batch, to_device
from ddiloco_cli.tasks import gpt
from ddiloco_cli.tasks.gpt import BASE_CHARS, GPTConfig, GPTTask, ensure_token_files, write_token_files
from support import REPO

TINY = GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=96)


@pytest.fixture
def tiny(excerpt_dir) -> GPTTask:
    return GPTTask(TINY, default_batch_size=16, data_dir=excerpt_dir)


@pytest.fixture(scope="module")
def positions_dir(tmp_path_factory) -> str:
    """Token files whose token at position i is i (so a window's first token is its start)."""
    data_dir = tmp_path_factory.mktemp("positions")
    np.arange(60_000, dtype=np.uint16).tofile(data_dir / "train.bin")
    np.arange(5_000, dtype=np.uint16).tofile(data_dir / "val.bin")
    (data_dir / "meta.json").write_text(json.dumps({
        "vocab": BASE_CHARS, "vocab_size": 96, "num_train_tokens": 60_000, "num_val_tokens": 5_000}))
    return str(data_dir)


# -- load_task -----------------------------------------------------------------------


def write_module(tmp_path: Path, body: str) -> str:
    path = tmp_path / "user_task.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_load_task_builtin_names_and_module_spec():
    assert load_task("tiny") is gpt.tiny
    assert load_task("ddiloco_cli.tasks.gpt:small") is gpt.small
    assert load_task("medium") is gpt.medium


@pytest.mark.parametrize("spec, needle", [
    ("tinyy", "expected MODULE:OBJECT"),
    ("ddiloco_cli.tasks.gpt", "expected MODULE:OBJECT"),
    ("no_such_module_xyz:task", "cannot import module 'no_such_module_xyz'"),
    ("ddiloco_cli.tasks.no_such:task", "cannot import module 'ddiloco_cli.tasks.no_such'"),
    ("ddiloco_cli.tasks.gpt:huge", "has no object 'huge'"),
    ("does/not/exist.py:task", "no such file"),
])
def test_load_task_errors_say_what_is_wrong(spec, needle):
    with pytest.raises(UsageError, match=needle):
        load_task(spec)


def test_load_task_missing_object_lists_candidates():
    with pytest.raises(UsageError) as e:
        load_task("ddiloco_cli.tasks.gpt:huge")
    assert "tiny" in str(e.value) and "medium" in str(e.value)


def test_load_task_names_the_missing_methods(tmp_path):
    path = write_module(tmp_path, """
        class Half:
            def build_model(self): ...
            def batches(self, *, shard, num_shards, seed, batch_size): ...
        half = Half()
    """)
    with pytest.raises(UsageError) as e:
        load_task(f"{path}:half")
    msg = str(e.value)
    assert "loss" in msg and "num_tokens" in msg and "lacks method(s) loss, num_tokens" in msg


def test_load_task_calls_classes_and_factories(tmp_path):
    path = write_module(tmp_path, """
        class Ok:
            def build_model(self): ...
            def batches(self, *, shard, num_shards, seed, batch_size): ...
            def loss(self, model, batch): ...
            def num_tokens(self, batch): ...
        def make():
            return Ok()
        def needs_args(n):
            return Ok()
    """)
    assert type(load_task(f"{path}:Ok")).__name__ == "Ok"
    assert type(load_task(f"{path}:make")).__name__ == "Ok"
    with pytest.raises(UsageError, match="callable with no arguments"):
        load_task(f"{path}:needs_args")


def test_missing_dependency_inside_task_module_keeps_its_traceback(tmp_path):
    path = write_module(tmp_path, "import no_such_dependency_xyz\n")
    with pytest.raises(ModuleNotFoundError):
        load_task(f"{path}:task")


def test_example_task_loads_trains_and_evaluates():
    task = load_task(str(REPO / "examples" / "my_task.py") + ":task")
    model = task.build_model()
    before = evaluate(task, model, batch_size=4096, max_batches=4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    stream = task.batches(shard=1, num_shards=2, seed=0, batch_size=256)
    for _ in range(30):
        loss = task.loss(model, next(stream))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert task.num_tokens(next(stream)) == 256
    assert evaluate(task, model, batch_size=4096, max_batches=4) < before - 0.5


# -- to_device / evaluate --------------------------------------------------------------


def test_to_device_handles_nested_batches():
    batch = {"x": torch.ones(2), "pair": (torch.zeros(1), [torch.ones(1)]), "n": 3}
    moved = to_device(batch, "meta")
    assert moved["x"].device.type == "meta"
    assert moved["pair"][0].device.type == "meta" and moved["pair"][1][0].device.type == "meta"
    assert isinstance(moved["pair"], tuple) and isinstance(moved["pair"][1], list) and moved["n"] == 3


def test_move_batch_prefers_the_tasks_own_to_device():
    class Own:
        def to_device(self, batch, device):
            return ("moved", device)
    assert move_batch(Own(), torch.ones(1), "cpu") == ("moved", "cpu")
    assert move_batch(object(), (torch.ones(1),), "meta")[0].device.type == "meta"


def test_evaluate_restores_mode_and_needs_val_batches(tiny):
    model = tiny.build_model()
    model.train()
    loss = evaluate(tiny, model, batch_size=8, max_batches=2)
    assert model.training
    assert abs(loss - math.log(96)) < 0.2  # fresh model: near-uniform over the vocabulary
    model.eval()
    evaluate(tiny, model, batch_size=8, max_batches=1)
    assert not model.training

    class NoVal:
        pass
    with pytest.raises(UsageError, match="val_batches"):
        evaluate(NoVal(), model, batch_size=8)


# -- the GPT model ----------------------------------------------------------------------


def test_tiny_gpt_forward_backward(tiny):
    model = tiny.build_model()
    assert model.config.vocab_size == tiny.meta["vocab_size"] == 96
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    names = [n for n, _ in model.named_parameters()]
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    assert 100_000 < sum(p.numel() for p in model.parameters()) < 1_000_000

    x, y = next(tiny.batches(shard=0, num_shards=1, seed=0, batch_size=4))
    assert model(x).shape == (4, 64, 96)
    loss = tiny.loss(model, (x, y))
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_build_model_is_identical_in_every_process(tiny):
    a, b = tiny.build_model(), tiny.build_model()
    torch.rand(3)  # global RNG state must not matter
    c = tiny.build_model()
    for (n, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(pa, pb) and torch.equal(pa, pc), n


def test_loss_decreases_over_50_adamw_steps_on_the_excerpt(tiny):
    torch.manual_seed(0)
    model = tiny.build_model()
    before = evaluate(tiny, model, batch_size=64, max_batches=4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    stream = tiny.batches(shard=0, num_shards=1, seed=0, batch_size=16)
    for _ in range(50):
        loss = tiny.loss(model, next(stream))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    after = evaluate(tiny, model, batch_size=64, max_batches=4)
    assert before > 4.3 and after < 3.4, (before, after)


def test_generate_extends_the_prompt(tiny):
    model = tiny.build_model()
    prompt = tiny.encode("ROMEO:")[None]
    out = model.generate(prompt, 10, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 16) and torch.equal(out[:, :6], prompt)
    assert tiny.decode(out[0, :6].tolist()) == "ROMEO:"


# -- batches -----------------------------------------------------------------------------


def test_num_tokens_counts_input_positions(tiny):
    batch = next(tiny.batches(shard=0, num_shards=1, seed=0, batch_size=5))
    assert tiny.num_tokens(batch) == 5 * 64 == batch[0].numel()


def test_shards_draw_only_from_their_own_slice(positions_dir):
    task = GPTTask(TINY, default_batch_size=16, data_dir=positions_dir)
    T, n, num_shards = 64, 60_000, 3
    starts = {}
    for shard in range(num_shards):
        stream = task.batches(shard=shard, num_shards=num_shards, seed=7, batch_size=32)
        xs, ys = zip(*(next(stream) for _ in range(20)))
        x, y = torch.cat(xs), torch.cat(ys)
        assert torch.equal(y, x + 1)  # targets are inputs shifted by one
        assert torch.equal(x, x[:, :1] + torch.arange(T))  # contiguous windows
        lo, hi = n * shard // num_shards, n * (shard + 1) // num_shards
        assert x[:, 0].min() >= lo and y[:, -1].max() < hi  # the window and its target stay inside
        starts[shard] = set(x[:, 0].tolist())
    assert not starts[0] & starts[1] and not starts[1] & starts[2]


def test_batches_are_reproducible_per_seed_and_shard(tiny):
    def first(**kw):
        return next(tiny.batches(num_shards=4, batch_size=8, **kw))[0]
    assert torch.equal(first(shard=1, seed=3), first(shard=1, seed=3))
    assert not torch.equal(first(shard=1, seed=3), first(shard=1, seed=4))
    assert not torch.equal(first(shard=1, seed=3), first(shard=2, seed=3))


def test_bad_shard_arguments_are_usage_errors(tiny):
    with pytest.raises(UsageError, match="outside"):
        next(tiny.batches(shard=4, num_shards=4, seed=0, batch_size=2))
    with pytest.raises(UsageError, match="fewer learners"):
        next(tiny.batches(shard=0, num_shards=100_000, seed=0, batch_size=2))


def test_val_batches_are_fixed_non_overlapping_windows(positions_dir, tiny):
    task = GPTTask(TINY, default_batch_size=16, data_dir=positions_dir)
    batches = list(task.val_batches(batch_size=10))
    x = torch.cat([b[0] for b in batches])
    assert torch.equal(x[:, 0], torch.arange(0, len(x) * 64, 64))
    assert len(x) == (5_000 - 1) // 64
    a, b = list(tiny.val_batches(batch_size=8)), list(tiny.val_batches(batch_size=8))
    assert len(a) == len(b) > 10
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))


# -- token files --------------------------------------------------------------------------


def test_excerpt_is_real_shakespeare_with_the_base_vocabulary(excerpt_dir):
    text = gpt.excerpt_text()
    assert 300_000 < len(text.encode()) < 600_000
    assert "To be, or not to be" in text and "gutenberg" not in text.lower()
    meta = json.loads(Path(excerpt_dir, "meta.json").read_text())
    assert meta["vocab"] == BASE_CHARS and meta["vocab_size"] == 96
    assert meta["num_train_tokens"] + meta["num_val_tokens"] == len(text)
    train = np.fromfile(Path(excerpt_dir, "train.bin"), dtype=np.uint16)
    assert gpt.decode(train[:6], meta["vocab"]) == text[:6]


def test_half_written_data_dir_is_rebuilt_and_mismatch_is_reported(tmp_path):
    data_dir = tmp_path / "d"
    data_dir.mkdir()
    (data_dir / "train.bin").write_bytes(b"\x00" * 10)  # a crash before meta.json: not a data set yet
    (data_dir / ".train.bin.abc").write_bytes(b"junk")
    meta = ensure_token_files(str(data_dir))
    assert (data_dir / "train.bin").stat().st_size == 2 * meta["num_train_tokens"]

    (data_dir / "val.bin").write_bytes(b"\x00" * 10)
    with pytest.raises(UsageError, match="prepare_data.py"):
        ensure_token_files(str(data_dir))


def test_write_token_files_pads_vocab_for_extra_characters(tmp_path):
    meta = write_token_files("héllo wörld\n" * 20, str(tmp_path), source="test")
    assert meta["vocab"].startswith(BASE_CHARS) and meta["vocab"][96:] == "éö"
    assert meta["vocab_size"] == 104 and meta["num_train_tokens"] == 216


def test_data_dir_comes_from_the_environment(monkeypatch, tmp_path, excerpt_dir):
    monkeypatch.setenv("DDILOCO_DATA_DIR", str(tmp_path / "env"))
    task = GPTTask(TINY, default_batch_size=16)
    assert task.build_model().config.vocab_size == 96
    assert (tmp_path / "env" / "meta.json").exists()


def test_strip_boilerplate():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import prepare_data
    finally:
        sys.path.pop(0)
    raw = ("The Project Gutenberg EBook of X\r\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\r\n\r\n\r\n\r\n"
           "ACT I.  \r\nHam.\r\nWords.\r\n*** END OF THIS PROJECT GUTENBERG EBOOK X ***\r\nLicense...\r\n")
    assert prepare_data.strip_boilerplate(raw) == "ACT I.\nHam.\nWords.\n"
