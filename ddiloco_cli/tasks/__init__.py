"""Bring your own model: the Task interface a learner trains, and how to load one.

A task is any object with these methods (a class or zero-argument factory works too):

    build_model() -> nn.Module
        A freshly initialised model. Every process calls it; the syncer replaces the
        weights with the global ones, so it need not be deterministic (ours are).
    batches(*, shard, num_shards, seed, batch_size) -> Iterator[batch]
        An endless stream of training batches from shard `shard` of `num_shards`.
        Distinct shards must give distinct data; equal arguments the same stream.
    loss(model, batch) -> Tensor
        Scalar training loss of model on batch (the learner calls backward on it).
    num_tokens(batch) -> int
        Tokens (or examples) in batch: the unit of the token-weighted merge.
    val_batches(*, batch_size) -> Iterable[batch]          (optional)
        A fixed, deterministic validation set; `ddiloco` evaluates on it.
    to_device(batch, device) -> batch                      (optional)
        Move a batch to a device; without it, `to_device` below is used.

    batches(..., start_step=0)  or  batches(..., state=None)  (optional resume)
        A task that accepts ``start_step`` continues its stream after that many
        batches; one that accepts ``state`` gets back what its iterator's
        ``state_dict()`` returned. The learner saves the position at every send in
        ``learners/ID/state.json``, so a restarted learner does not replay its data.

Pick one on the command line with ``--task module.path:object``,
``--task path/to/file.py:object`` or a built-in name (``tiny``, ``small``, ``medium``).
A class or function takes keyword arguments from a ``?key=value&...`` tail, e.g.
``ddiloco_cli.tasks.hf:causal_lm?config=llama&num_hidden_layers=2``; they are part of
the spec recorded in run.json, so every process builds the same task.

Tasks are code, never bucket data: ``run.json`` records the task's name and the
sha256 of its module's source (``task_sha256``). A learner imports the task from
its own environment (``load_run_task``): the module named in run.json, or its own
``learn --task``; a file path is only ever taken from the learner's own command
line, and a source that differs from the run's is refused.
"""

import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import sys
import urllib.parse
from typing import Any, Iterator, Protocol, runtime_checkable

import torch
import torch.nn as nn

from ddiloco_cli.errors import UsageError

REQUIRED_METHODS = ("build_model", "batches", "loss", "num_tokens")
BUILTIN_TASKS = {name: f"ddiloco_cli.tasks.gpt:{name}" for name in ("tiny", "small", "medium")}


@runtime_checkable
class Task(Protocol):
    def build_model(self) -> nn.Module: ...

    def batches(self, *, shard: int, num_shards: int, seed: int, batch_size: int) -> Iterator[Any]: ...

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor: ...

    def num_tokens(self, batch: Any) -> int: ...


def to_device(batch: Any, device: torch.device | str) -> Any:
    """Move every tensor in batch (a tensor, or tuples/lists/dicts of them, nested) to device."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def move_batch(task: Task, batch: Any, device: torch.device | str) -> Any:
    """task.to_device(batch, device) if the task defines it, else to_device(batch, device)."""
    move = getattr(task, "to_device", None)
    return move(batch, device) if callable(move) else to_device(batch, device)


def _import_module(module_ref: str):
    if _is_path(module_ref):
        path = os.path.abspath(module_ref)
        if not os.path.isfile(path):
            raise UsageError(f"--task: no such file {module_ref!r}")
        name = "ddiloco_user_task_" + os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling-free introspection need it
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module
    try:
        return importlib.import_module(module_ref)
    except ModuleNotFoundError as e:
        # Only a missing *task module* is a usage error; a missing dependency inside it is
        # the task's own bug and keeps its traceback.
        if e.name is not None and (module_ref == e.name or module_ref.startswith(e.name + ".")):
            raise UsageError(f"--task: cannot import module {module_ref!r} (no module named {e.name!r}); "
                             f"check the spelling and that it is on PYTHONPATH, or pass path/to/file.py:object") from e
        raise


def _is_path(module_ref: str) -> bool:
    return module_ref.endswith(".py") or os.sep in module_ref or "/" in module_ref


def load_task(spec: str) -> Task:
    """Resolve spec to a task object.

    spec is "module.path:object", "path/to/file.py:object", or a built-in task name
    (see BUILTIN_TASKS). If the object is a class or a function, it is called with no
    arguments and the result is the task. Raises UsageError when the module, object or
    one of the required methods is missing (the message names what is missing)."""
    spec = BUILTIN_TASKS.get(spec, spec)
    spec, _, arg_text = spec.partition("?")
    args = _task_args(spec, arg_text)
    module_ref, sep, attr = spec.rpartition(":")
    if not sep or not module_ref or not attr:
        raise UsageError(f"--task {spec!r}: expected MODULE:OBJECT or path/to/file.py:OBJECT, "
                         f"or one of {', '.join(BUILTIN_TASKS)}")
    module = _import_module(module_ref)
    if not hasattr(module, attr):
        candidates = [n for n, v in vars(module).items() if not n.startswith("_") and _looks_like_task(v)]
        hint = f"; task-like objects there: {', '.join(candidates)}" if candidates else ""
        raise UsageError(f"--task {spec!r}: module {module_ref!r} has no object {attr!r}{hint}")
    obj = getattr(module, attr)
    if inspect.isclass(obj) or inspect.isfunction(obj):
        try:
            inspect.signature(obj).bind(**args)
        except TypeError as exc:
            raise UsageError(f"--task {spec!r}: {attr} must be callable with "
                             f"{'the arguments given (' + str(exc) + ')' if args else 'no arguments'} "
                             f"(or be a task instance)") from None
        obj = obj(**args)
    elif args:
        raise UsageError(f"--task {spec!r}: arguments given, but {attr} is not a class or function")
    missing = [m for m in REQUIRED_METHODS if not callable(getattr(obj, m, None))]
    if missing:
        raise UsageError(f"--task {spec!r}: {type(obj).__name__} object lacks method(s) "
                         f"{', '.join(missing)}; a task needs {', '.join(REQUIRED_METHODS)}")
    return obj


def _task_args(spec: str, arg_text: str) -> dict[str, Any]:
    """Keyword arguments from a spec's ``?key=value&...`` tail (so they travel in run.json):
    a value that parses as a JSON number, boolean or null is that, else a string."""
    args: dict[str, Any] = {}
    for key, value in urllib.parse.parse_qsl(arg_text, keep_blank_values=True, strict_parsing=bool(arg_text)):
        if not key.isidentifier():
            raise UsageError(f"--task {spec}?{arg_text}: {key!r} is not an argument name")
        try:
            parsed = json.loads(value)
            args[key] = parsed if isinstance(parsed, (int, float, bool)) or parsed is None else value
        except ValueError:
            args[key] = value
    return args


def _module_ref(spec: str) -> str:
    """The module part of a task spec (built-in names resolved, ``?args`` dropped)."""
    return BUILTIN_TASKS.get(spec, spec).partition("?")[0].rpartition(":")[0]


def task_source_sha256(spec: str) -> str:
    """sha256 of the source file of the module that defines task ``spec`` (what
    ``run.json`` records as ``task_sha256``)."""
    module_ref = _module_ref(spec)
    module = _import_module(module_ref)
    path = getattr(module, "__file__", None)
    if not path or not os.path.isfile(path):
        raise UsageError(f"--task {spec!r}: module {module_ref!r} has no source file to fingerprint")
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def load_run_task(run: dict[str, Any], *, override: str | None = None) -> Task:
    """The task of ``run`` from this machine's own code: ``override`` (the learner's
    ``--task``) if given, else the importable module named in run.json. A file path
    in run.json is refused (code is never loaded from the bucket), and so is a task
    whose source sha256 differs from the run's ``task_sha256``."""
    spec = override or run["task"]
    if override is None and _is_path(_module_ref(spec)):
        raise UsageError(f"run.json names the task by a file path ({spec!r}); a learner never loads code named by "
                         f"the bucket: pass --task MODULE:OBJECT or --task path/to/your/copy.py:OBJECT")
    task = load_task(spec)
    want = run.get("task_sha256")
    if want is not None:
        have = task_source_sha256(spec)
        if have != want:
            raise UsageError(f"task {spec!r}: its source (sha256 {have[:12]}...) differs from the run's "
                             f"(task_sha256 {want[:12]}... for {run['task']!r}); install the same task code "
                             f"as the run's creator, or pass --task pointing at it")
    return task


def _looks_like_task(obj: Any) -> bool:
    return all(callable(getattr(obj, m, None)) for m in REQUIRED_METHODS)


def evaluate(task: Task, model: nn.Module, *, batch_size: int, max_batches: int | None = None,
             device: torch.device | str | None = None) -> float:
    """Mean validation loss per token (each batch weighted by task.num_tokens) over the
    first max_batches batches of task.val_batches (all if None), under torch.no_grad and
    model.eval(); the model's train/eval mode is restored after. device defaults to the
    device of the model's first parameter. Raises UsageError if the task has no
    val_batches or it yields nothing."""
    val_batches = getattr(task, "val_batches", None)
    if not callable(val_batches):
        raise UsageError(f"task {type(task).__name__} defines no val_batches(*, batch_size); cannot evaluate")
    if device is None:
        device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total_loss, total_tokens = 0.0, 0
    try:
        with torch.no_grad():
            for i, batch in enumerate(val_batches(batch_size=batch_size)):
                if max_batches is not None and i >= max_batches:
                    break
                n = task.num_tokens(batch)
                total_loss += task.loss(model, move_batch(task, batch, device)).item() * n
                total_tokens += n
    finally:
        model.train(was_training)
    if total_tokens == 0:
        raise UsageError(f"task {type(task).__name__}: val_batches yielded no data")
    return total_loss / total_tokens


__all__ = ["Task", "BUILTIN_TASKS", "load_task", "load_run_task", "task_source_sha256", "to_device", "move_batch", "evaluate"]
