"""What `ddiloco learn` shows (issue 26 item 2): a progress bar with step/total,
tokens/s and ETA on a terminal, tok/s in the plain lines, a line saying where a
restarted learner's data stream continues, and a one-line summary at the end."""

from __future__ import annotations

import io
import logging

from rich.console import Console

from ddiloco_cli.cli.live import learner_view
from ddiloco_cli.learner.learn import resumable_batches
from ddiloco_cli.learner.progress import log_step, summary
from ddiloco_cli.learner.stats import LearnerStats


def _progress(step: int) -> dict:
    return {"step": step, "loss": 2.5, "lr": 1e-3, "step_time_s": 0.5, "tokens": step * 512, "bytes_up": 2_000_000,
            "bytes_down": 3_000_000, "versions": {0: 3, 1: 4}, "blocked_s": 0.0}


def test_the_terminal_bar_shows_step_of_total_tokens_per_s_and_eta():
    console = Console(file=io.StringIO(), force_terminal=True, width=200, color_system=None)
    with learner_view(console, "alice", session_steps=40, live=True) as update:
        update(_progress(11))  # a resumed session (--steps 40 from step 10): steps 11..50
    text = console.file.getvalue()
    assert "alice" in text and "/50" in text, text[-500:]
    assert "1,024 tok/s" in text and "ETA 0:00:" in text, text[-500:]


def test_off_a_terminal_the_view_is_none_and_the_plain_line_has_tokens_per_s(caplog):
    with learner_view(Console(file=io.StringIO()), "alice", live=False) as update:
        assert update is None
    stats = LearnerStats(step=20, tokens=10240, loss=2.5, step_time_s=0.25, bytes_up=10**6, bytes_down=2 * 10**6)
    with caplog.at_level(logging.INFO, logger="ddiloco_cli.learner"):
        log_step(20, stats, lr=1e-3, tokens_per_step=512)
    assert "step 20 loss 2.5000" in caplog.text and "2,048 tok/s" in caplog.text


class _Task:
    def batches(self, *, shard, num_shards, seed, batch_size, start_step=0):
        return iter(range(start_step, 10**6))


def test_a_resumed_data_stream_says_where_it_continues(caplog):
    with caplog.at_level(logging.INFO, logger="ddiloco_cli.learner"):
        stream, _ = resumable_batches(_Task(), shard=0, num_shards=1, seed=0, batch_size=8, resume=None)
        assert "continuing" not in caplog.text
        stream, _ = resumable_batches(_Task(), shard=0, num_shards=1, seed=0, batch_size=8,
                                      resume={"start_step": 30})
    assert next(stream) == 30
    assert "continuing the data stream from example 240 (batch 30 of this shard)" in caplog.text


def test_the_summary_is_one_line_with_the_session_totals():
    stats = LearnerStats(step=48, tokens=24576, num_contributions=24, num_refused=1, bytes_up=3_500_000,
                         bytes_down=7_250_000)
    line = summary("alice", "finished", stats)
    assert line == ("learner alice: finished; step 48, 24,576 tokens, 24 contributions sent, 1 refused, "
                    "up 3.5 MB, down 7.2 MB")
