"""Resolve the task of a run: a built-in name, an import path, a :class:`~espert.tasks.Task`, a loader or a
reward function with its prompts, into ``(spec, source, train_task, eval_task)``; and the fingerprint of its
problems (logged when a run starts, checked on resume)."""

from __future__ import annotations

import hashlib
import json
import re
from typing import TYPE_CHECKING, Any, Callable

from espert.jail import sandbox

from .code import runs_code
from .loaders import custom_task, import_object, load_task, object_path

if TYPE_CHECKING:  # pragma: no cover
    from espert.config import ESConfig

#: How the task of a run was given (logged in its ``task`` record).
TASK_SOURCES = ("builtin", "import", "python")
#: ``config.yaml``'s ``task`` for a Python object that has no import path.
PYTHON_PREFIX = "python:"


def resolve_tasks(
    cfg: ESConfig, task: Any = None, reward: Callable | None = None, prompts: Any = None, eval_prompts: Any = None
) -> tuple[str, str, Any, Any]:
    """``(spec, source, train_task, eval_task or None)`` for a run.

    task: None (use ``cfg.task``), a Task, a loader ``fn(split) -> Task``, a reward
    ``fn(prompts, completions, answers)`` or an import path string.  reward + prompts: a reward
    function and its training problems (a list of prompts, of ``{"prompt", "answer"}`` dicts or of
    pairs, a JSONL path or a ``datasets`` split); eval_prompts: held-out problems in the same form
    (default: ``cfg.eval_data``; none: no held-out evaluation).  spec is what ``config.yaml``
    records as ``task``: the import path when the object can be re-imported, else
    ``python:NAME``.  source: ``builtin``, ``import`` (the config alone rebuilds the task) or
    ``python`` (a resume must be given the same objects again).
    """
    if reward is not None:
        if task is not None:
            raise ValueError("give either task= or reward= (with prompts=), not both")
        if prompts is None and cfg.train_data is None:
            raise ValueError("reward= needs prompts= (a list, a JSONL path or a datasets split) or train_data")
        task = reward
    if task is None and ":" not in cfg.task:  # a built-in task, as before
        train = load_task(cfg.task, "train", n=cfg.train_size, path=cfg.train_data)
        evalt = load_task(cfg.task, cfg.eval_split, n=cfg.eval_size, path=cfg.eval_data) if cfg.eval_size else None
        return cfg.task, "builtin", _code_allowed(cfg, _nonempty(train, cfg.task)), _code_allowed(cfg, evalt)
    if task is None or isinstance(task, str):
        spec = task or cfg.task
        obj, source = import_object(spec), "import"
    else:
        obj, spec = task, object_path(task)
        name = getattr(task, "name", None) or getattr(task, "__name__", None) or "custom"
        # problems given from Python are not in the config: such a run resumes only from Python
        source = "import" if spec is not None and prompts is None and eval_prompts is None else "python"
        spec = spec or PYTHON_PREFIX + (re.sub(r"\W", "_", name).lstrip("_0123456789") or "custom")
    name = spec.rsplit(":", 1)[-1]
    train = custom_task(obj, "train", n=cfg.train_size, path=cfg.train_data, name=name, problems_from=prompts)
    evalt = None
    if cfg.eval_size:
        evalt = custom_task(
            obj, cfg.eval_split, n=cfg.eval_size, path=cfg.eval_data, name=name, problems_from=eval_prompts
        )
    return spec, source, _code_allowed(cfg, _nonempty(train, spec)), _code_allowed(cfg, evalt)


def _code_allowed(cfg: ESConfig, task):
    """``task``, once its code reward may run here: in a jail, or unjailed with ``unsafe_code_reward`` (which
    this sets for the process); otherwise :class:`~espert.jail.sandbox.JailUnavailable`, before anything is
    written."""
    sandbox.allow_unsafe_code(getattr(cfg, "unsafe_code_reward", False))
    if task is not None and runs_code(task):
        sandbox.code_jail()
    return task


def load_spec_task(spec: str, split: str, n: int | None = None, path: str | None = None):
    """The problems of ``split`` of a task named as a run's config names it: a built-in name
    (:func:`load_task`) or an import path ``package.module:name`` (:func:`custom_task`; a reward
    function takes its problems from ``path``).  None when the task has no problems for ``split``.  A code
    task is refused here where no jail can be made (``ESPERT_UNSAFE_CODE_REWARD=1`` allows it unjailed)."""
    if ":" not in spec:
        task = load_task(spec, split, n=n, path=path)
    else:
        task = custom_task(import_object(spec), split, n=n, path=path, name=spec.rsplit(":", 1)[-1])
    if task is not None and runs_code(task):
        sandbox.code_jail()
    return task


def _nonempty(task, spec):
    if task is None or len(task) == 0:
        raise ValueError(f"task {spec!r} has no training problems")
    return task


def task_fingerprint(*tasks) -> str:
    """sha256 of the problems (prompts and answers) of the given tasks (None: absent)."""
    h = hashlib.sha256()
    for t in tasks:
        doc = None if t is None else [t.prompts, t.answers]
        h.update(json.dumps(doc, default=str, ensure_ascii=False).encode())
        h.update(b"\n")
    return h.hexdigest()
