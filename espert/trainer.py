"""A training run: tasks in, run directory out (orchestration around :func:`espert.es.es_step`).

``espert.train`` is :func:`train`.  It resolves the task (a built-in name, an import path, a
:class:`~espert.tasks.Task`, or a reward function with its prompts), opens the run directory
(:mod:`espert.runs`), builds the evaluator, restores the center from checkpoint + log, and runs
the iterations: per iteration one ``es_step``, held-out evaluations, checkpoints, and the
metrics to the optional trackers (:mod:`espert.tracking`).

Resume rules enforced here (beyond the config check of :meth:`espert.runs.Run.open`):

- the task is resolved again (an import path is re-imported; a Python object must be passed
  again) and its problems must hash to the fingerprint logged when the run started;
- the prompt indices of every logged iteration must equal the ones the config derives, so a
  sampler that changed under the run (e.g. CPython's ``random`` between versions, for runs with
  ``prompt_sampler: python_random``) is refused instead of silently diverging.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import time
from typing import Any, Callable

from espert.config import ESConfig
from espert.diagnostics import IterationMeter
from espert.es import es_step, prompt_indices

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
    from espert.tasks import load_task
    from espert.tasks.loaders import custom_task, import_object, object_path

    if reward is not None:
        if task is not None:
            raise ValueError("give either task= or reward= (with prompts=), not both")
        if prompts is None and cfg.train_data is None:
            raise ValueError("reward= needs prompts= (a list, a JSONL path or a datasets split) or train_data")
        task = reward
    if task is None and ":" not in cfg.task:  # a built-in task, as before
        train = load_task(cfg.task, "train", n=cfg.train_size, path=cfg.train_data)
        evalt = load_task(cfg.task, cfg.eval_split, n=cfg.eval_size, path=cfg.eval_data) if cfg.eval_size else None
        return cfg.task, "builtin", _nonempty(train, cfg.task), evalt
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
    return spec, source, _nonempty(train, spec), evalt


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


def _stored_config(run_dir: str) -> ESConfig:
    from espert.runs import read_run_config

    return ESConfig.from_dict(read_run_config(run_dir)["config"])


def _task_record(records: list[dict]) -> dict | None:
    return next((r for r in records if r.get("kind") == "task"), None)


def _refuse_python_task(run_dir: str) -> None:
    import os

    from espert.runs import LOG, read_log

    rec = _task_record(read_log(os.path.join(run_dir, LOG)))
    if rec is not None and rec.get("source") == "python":
        raise ValueError(
            f"{run_dir} was trained on a task given as Python objects ({rec.get('spec')!r}); they are "
            f"not in its config, so resume it from Python: espert.train(cfg, run_dir, resume=True, "
            f"task=... or reward=..., prompts=...) with the same task"
        )


def _check_task_record(run, spec: str, fingerprint: str) -> None:
    """On resume: the task must be the one the run started with (old runs have no record: skipped)."""
    rec = _task_record(run.records)
    if rec is None:
        return
    if rec.get("fingerprint") != fingerprint:
        raise ValueError(
            f"the problems of task {spec!r} differ from those {run.path} was trained on "
            f"(fingerprint mismatch); resume needs the same task and data"
        )


def _check_prompt_log(cfg: ESConfig, run, pool: int) -> None:
    """Every logged iteration's prompt indices must be what the config derives (see module doc)."""
    for rec in run.iterations():
        logged = rec.get("prompt_indices")
        if logged is not None and logged != prompt_indices(cfg, rec["iteration"], pool):
            raise ValueError(
                f"{run.path}: the prompts logged for iteration {rec['iteration']} differ from the ones "
                f"prompt_sampler={cfg.prompt_sampler!r} derives here (Python's random module changed?); "
                f"the run cannot continue identically (replay still rebuilds its weights)"
            )


def noise_energy(evaluator) -> float | None:
    """Σ_t n_t·s_t² over the moved tensors (see :func:`espert.es.step_norm`); None when unknown."""
    center = getattr(evaluator, "center", None)
    views = getattr(center, "views", None)
    if views is not None:
        scales = getattr(center, "sigma_scales", None) or [1.0] * len(views)
        return float(sum(v.numel * s * s for v, s in zip(views, scales)))  # quantized: in code units
    scales = getattr(evaluator, "sigma_scales", None) or {}  # vLLM: {logical name: s} with sigma_mode rms
    from espert.center import OPTIM_PREFIX

    try:
        stream = getattr(evaluator, "center_stream", lambda: None)()  # streaming: count its layout, pull nothing
        if stream is not None:
            sizes = {n: math.prod(s) for n, (s, _) in stream.layout.items() if not n.startswith(OPTIM_PREFIX)}
        else:
            sizes = {n: t.numel() for n, t in evaluator.export_state().items()}
        return float(sum(k * scales.get(n, 1.0) ** 2 for n, k in sizes.items()))
    except Exception:  # noqa: BLE001 - a metric only; the run does not depend on it
        return None


def iteration_metrics(rec: dict) -> dict:
    """The scalar metrics of an ``iter`` record (what trackers receive)."""
    m = {f"reward/{k}": v for k, v in rec["reward"].items() if v is not None}
    m.update({k: rec[k] for k in ("sigma", "alpha", "step_norm", "eval_seconds") if rec.get(k) is not None})
    js = ((rec.get("diagnostics") or {}).get("answers") or {}).get("js")
    if js is not None:
        m["answers/js"] = js
    return m


def train(
    cfg: ESConfig | None,
    run_dir: str,
    resume: bool = False,
    progress: bool = True,
    hook: Callable[[int, str], None] | None = None,
    echo: Callable[[str], None] | None = print,
    *,
    task: Any = None,
    reward: Callable | None = None,
    prompts: Any = None,
    eval_prompts: Any = None,
) -> dict:
    """Train (or resume) a run in ``run_dir``; returns a summary dict
    ``{"run_dir", "iterations", "heldout": [(t, mean)], "train_reward": [(t, mean)], "export"}``.

    cfg: the run's config; with ``resume`` it may be None (use the stored one) or must match the
    stored one except for ``runs.RESUMABLE_CHANGES``.  echo: where status lines go (None: nowhere).
    task / reward / prompts / eval_prompts: a custom task (see :func:`resolve_tasks`); its import
    path (or name) is recorded as ``task`` in config.yaml, and a resume resolves it again.

    hook(t, phase) is called at phases ``"logged"`` (record appended, update not yet applied),
    ``"updated"`` and ``"checkpointed"`` of each iteration; tests use it to crash a run anywhere.
    """
    import torch

    from espert import runs
    from espert.tracking import Trackers

    if resume and cfg is None:
        cfg = _stored_config(run_dir)
    if resume and task is None and reward is None:
        _refuse_python_task(run_dir)
    if cfg is None:
        raise ValueError("a new run needs a config (cfg=None is only for resuming)")
    spec, source, train_task, eval_task = resolve_tasks(cfg, task, reward, prompts, eval_prompts)
    if spec != cfg.task:
        cfg = dataclasses.replace(cfg, task=spec)
    fingerprint = task_fingerprint(train_task, eval_task)
    run = runs.Run.open(run_dir, cfg, resume=resume, echo=echo)
    cfg = run.cfg
    say = echo or (lambda s: None)
    threads = torch.get_num_threads()
    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    evaluator = trackers = None
    try:
        if resume:
            _check_task_record(run, spec, fingerprint)
            _check_prompt_log(cfg, run, len(train_task))
        if _task_record(run.records) is None and not run.iterations():
            run.append(
                {
                    "kind": "task",
                    "spec": spec,
                    "source": source,
                    "fingerprint": fingerprint,
                    "n_train": len(train_task),
                    "n_eval": None if eval_task is None else len(eval_task),
                }
            )
        if eval_task is None and cfg.eval_size:
            say(
                f"[espert] task {spec!r} has no held-out problems (give eval_data or eval_prompts); "
                f"held-out evaluation is off"
            )
        from espert.evaluators import build_evaluator
        from espert.tasks.rewards import answer_equivalence

        evaluator = build_evaluator(cfg, run.base_path, train_task.score, train_task.extract)
        energy = noise_energy(evaluator)
        meter = IterationMeter(evaluator, run.iterations(), answer_equivalence(train_task.name))
        start = run.restore(evaluator)
        T = cfg.iterations
        if start > T:
            raise ValueError(f"{run_dir} already logged {start} iterations, more than iterations={T}")
        trackers = Trackers(cfg.trackers, run.path, cfg.tracker_project, cfg.to_dict(), say)
        # iteration `start`'s evaluation and checkpoint, if a kill cut them off (or the base model's, at 0)
        ev = run.finish_iteration(evaluator, eval_task, start, hook)
        if ev is not None:
            trackers.log({"heldout/mean": ev["mean"]}, start)
        bar = _progress(progress, T, start)
        for t in range(start + 1, T + 1):
            idx = prompt_indices(cfg, t, len(train_task))

            def write_ahead(rec: dict) -> None:
                rec["prompt_indices"] = idx
                rec["time"] = time.time()
                rec["diagnostics"] = meter(rec)  # Corr(X+,X-), kappa, reward spread, answer JS, cumulative FLOPs
                run.append(rec)
                if hook:
                    hook(rec["iteration"], "logged")

            meter.start()
            rec = es_step(
                evaluator,
                cfg,
                t,
                [train_task.prompts[i] for i in idx],
                [train_task.answers[i] for i in idx],
                write_ahead,
                noise_energy=energy,
            )
            if hook:
                hook(t, "updated")
            trackers.log(iteration_metrics(rec), t)
            if rec["skipped"]:
                say(f"[espert] iteration {t}: every member failed; update skipped")
            ev = run.finish_iteration(evaluator, eval_task, t, hook)  # held-out evaluation and checkpoint when due
            if ev is not None:
                trackers.log({"heldout/mean": ev["mean"]}, t)
            if bar is not None:
                last_eval = run.last_eval()
                post = {"r_mean": rec["reward"]["mean"], "r_std": rec["reward"]["std"]}
                if last_eval is not None:
                    post["heldout"] = last_eval["mean"]
                bar.set_postfix(
                    {k: ("nan" if v is None or not math.isfinite(v) else f"{v:.3f}") for k, v in post.items()},
                    refresh=False,
                )
                bar.update(1)
        if bar is not None:
            bar.close()
        if run.checkpoint_iteration() != T:  # e.g. iterations: 0 (finish_iteration checkpoints t >= 1)
            run.checkpoint(evaluator, T)
            if hook:
                hook(T, "checkpointed")
        return run.summary()
    finally:
        if trackers is not None:
            trackers.close()
        if evaluator is not None:
            evaluator.close()
        run.close()
        torch.set_num_threads(threads)


def _progress(enabled: bool, total: int, initial: int):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="espert train", unit="it", dynamic_ncols=True)


__all__ = ["train", "resolve_tasks", "task_fingerprint", "iteration_metrics", "noise_energy"]
