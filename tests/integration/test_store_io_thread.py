"""The S3 and GCS stores make their requests on ddiloco's own event-loop thread (``ddiloco-io``,
not fsspec's shared one), and a learner's cost report counts that thread's CPU: on S3 the client
costs about 2.6 ms of CPU a request, more than the learner's own per-step work on a local bucket
(docs/results.md), and it ran where no report looked."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from ddiloco_cli.learner.stats import threads_cpu_s
from ddiloco_cli.store import open_store
from ddiloco_cli.store.base import NotFound, io_threads

if not hasattr(time, "pthread_getcpuclockid"):
    pytest.skip("no per-thread CPU clocks on this platform", allow_module_level=True)

TINY = "ddiloco_cli.tasks.gpt:tiny"


def _fsspec_thread() -> threading.Thread | None:
    import fsspec.asyn

    return fsspec.asyn.iothread[0]


@pytest.mark.parametrize("backend", [pytest.param("s3", marks=pytest.mark.s3),
                                     pytest.param("gcs", marks=pytest.mark.gcs)])
def test_a_bucket_stores_requests_run_on_ddilocos_io_thread(store_url, backend):
    store = open_store(store_url(backend))
    (thread,) = io_threads(store)  # through the retrying wrapper open_store adds
    assert thread.name == "ddiloco-io" and thread.is_alive()
    assert thread is not _fsspec_thread()
    fsspec_thread = _fsspec_thread()
    fsspec_before = threads_cpu_s([fsspec_thread]) if fsspec_thread is not None else None
    before = threads_cpu_s([thread])
    for i in range(20):  # (S3's GETs and PUTs take the lean path on this thread: store/s3fast.py)
        assert store.put_if_absent(f"x/{i:02d}", b"y" * 1000)
        assert store.get(f"x/{i:02d}") == b"y" * 1000
        with pytest.raises(NotFound):
            store.get(f"missing/{i}")
        assert [o.key for o in store.list("x/")][-1] == f"x/{i:02d}"  # s3fs's, on either backend
    assert threads_cpu_s([thread]) > before  # those requests' client work, on that thread
    if fsspec_thread is not None:  # started by something else in this process: it made none of them
        assert threads_cpu_s([fsspec_thread]) - fsspec_before < threads_cpu_s([thread]) - before
    # a second store shares the thread (one per process)
    assert io_threads(open_store(store_url(backend))) == [thread]


def test_local_and_memory_stores_have_no_io_thread(store_url):
    assert io_threads(open_store(store_url("local"))) == []
    assert io_threads(open_store(store_url("memory"))) == []


@pytest.mark.s3
def test_a_learner_on_s3_counts_the_io_thread_in_its_cost(store_url):
    from ddiloco_cli import DiLoCoSync
    from ddiloco_cli.ops.runinit import RunSpec, init_run
    from ddiloco_cli.tasks import load_task

    store = open_store(store_url("s3"))
    init_run(store, RunSpec(task=TINY, num_fragments=2, sync_every=4, overlap_steps=1, codec="int4", total_steps=0,
                            warmup_steps=0, batch_size=4))
    model = load_task(TINY).build_model()
    with DiLoCoSync(store, model, learner_id=f"io-{uuid.uuid4().hex[:6]}") as sync:
        seen = []
        fields = sync._cost.fields

        def spy(step, workers):
            workers = list(workers)
            seen.append(workers)
            return fields(step, workers)

        sync._cost.fields = spy
        for _ in range(8):
            sync.step(num_tokens=1)
        sync._heartbeat_record()
    (io,) = io_threads(store)
    assert seen and all(io in workers for workers in seen)
