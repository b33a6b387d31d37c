"""`ddiloco export`: the latest global model as one safetensors file, or as a Hugging
Face ``save_pretrained`` directory (``--hf-dir``).

The file holds the task model's full ``state_dict()`` (tied weights appear under
every name ``state_dict`` uses, each as its own copy, since safetensors refuses
shared storage), so ``model.load_state_dict(load_file(path), strict=True)``
works on a freshly built task model. Its metadata carries the run config
(``ddiloco_run``, JSON) and the fragment versions it was assembled from
(``versions``, JSON ``{fragment: version}``).
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ddiloco_cli.errors import UsageError
from ddiloco_cli.ops.metrics import check_output_path, make_parent
from ddiloco_cli.protocol import layout, ledger
from ddiloco_cli.protocol.fragments import assemble_parameters  # noqa: F401 - re-exported
from ddiloco_cli.protocol.published import read_global_params
from ddiloco_cli.protocol.signing import Trust
from ddiloco_cli.store.base import Store
from ddiloco_cli.tasks import load_run_task, load_task


def export_model(store: Store, out_path: str, *, task_spec: str | None = None) -> dict[str, Any]:
    """Write the newest committed version of every fragment, assembled into the run's
    task model, to ``out_path`` (a local file, replaced atomically).

    Returns {run_id, num_params, versions: {fragment: version}, path}. Raises
    RunNotFoundError, ProtocolError / InvalidPayloadError on bad bucket content, and
    UsageError when the task cannot be built or does not match the run's plan.
    """
    check_output_path(out_path)  # a bad OUT fails before any bucket read
    run, plan, model, versions = _global_model(store, task_spec)
    state = {k: t.detach().to("cpu").clone().contiguous() for k, t in model.state_dict().items()}
    metadata = {"ddiloco_run": json.dumps(run, sort_keys=True),
                "versions": json.dumps({str(p): v for p, v in versions.items()})}

    fd, tmp = tempfile.mkstemp(prefix=".export-", suffix=".safetensors", dir=make_parent(out_path))
    os.close(fd)
    try:
        save_file(state, tmp, metadata=metadata)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp (and safetensors) make 0600; the export is an ordinary file
        os.replace(tmp, out_path)
    except BaseException:
        os.unlink(tmp)
        raise
    return {"run_id": run["run_id"], "num_params": plan.total_numel(), "versions": versions, "path": out_path}


def _umask() -> int:
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


def _global_model(store: Store, task_spec: str | None) -> tuple[dict[str, Any], Any, torch.nn.Module, dict[int, int]]:
    """(run, plan, the task model holding the newest global parameters, versions); the
    task is this machine's code (``task_spec`` overrides run.json's, like ``learn --task``)."""
    run = ledger.read_run(store)
    plan = ledger.read_plan(store, run_id=run["run_id"])
    params, versions = read_global_params(store, run_id=run["run_id"], plan=plan, trust=Trust(store, run=run))
    model = load_run_task(run, override=task_spec).build_model()
    named = dict(model.named_parameters())
    plan.check_model(named)
    with torch.no_grad():
        for name, param in named.items():
            param.copy_(params[name])
    return run, plan, model, versions


def export_hf(store: Store, out_dir: str, *, task_spec: str | None = None) -> dict[str, Any]:
    """Write the newest global model as a Hugging Face ``save_pretrained`` directory
    (config.json + model.safetensors, the byte-level tokenizer of the hf task and a
    README.md model card: ``hfexport``) that ``AutoModelForCausalLM.from_pretrained(out_dir)``
    loads. The run's task must build a transformers ``PreTrainedModel`` (e.g.
    ``ddiloco_cli.tasks.hf:causal_lm``). Returns like export_model."""
    check_output_path(out_dir, directory=True)
    run, plan, model, versions = _global_model(store, task_spec)
    if not callable(getattr(model, "save_pretrained", None)):
        raise UsageError(f"the run's task {run['task']!r} builds a {type(model).__name__}, not a transformers "
                         f"model; export it as OUT.safetensors instead of --hf-dir")
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    from ddiloco_cli.ops import hfexport
    from ddiloco_cli.ops.metrics import latest_global_eval

    if getattr(getattr(model, "config", None), "vocab_size", None) == hfexport.BYTE_VOCAB:
        hfexport.save_byte_tokenizer(out_dir)
    val = latest_global_eval(store, infos=store.list(f"{layout.METRICS_PREFIX}syncer/"))
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write(hfexport.model_card(run, versions, num_params=plan.total_numel(), val=val))
    return {"run_id": run["run_id"], "num_params": plan.total_numel(), "versions": versions, "path": out_dir}


def exported_metadata(path: str) -> dict[str, Any]:
    """{"run": run config, "versions": {fragment: version}} from an exported file."""
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
    if "ddiloco_run" not in meta:
        raise UsageError(f"{path} was not written by `ddiloco export` (no ddiloco_run metadata)")
    return {"run": json.loads(meta["ddiloco_run"]),
            "versions": {int(p): v for p, v in json.loads(meta.get("versions", "{}")).items()}}


def load_exported(path: str, task_spec: str | None = None) -> torch.nn.Module:
    """A fresh model of ``task_spec`` (default: the task recorded in the file) with the
    exported weights loaded strictly."""
    if task_spec is None:
        task_spec = exported_metadata(path)["run"]["task"]
    model = load_task(task_spec).build_model()
    model.load_state_dict(load_file(path), strict=True)
    return model
