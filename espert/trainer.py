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
import functools
import math
import time
from typing import Any, Callable

from espert.config import ESConfig
from espert.diagnostics import IterationMeter
from espert.es import es_step, prompt_indices
from espert.extras import check_config
from espert.runs import legacy
from espert.tasks import resolve_tasks, task_fingerprint


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
    """On resume: the task must be the one the run started with."""
    rec = _task_record(run.records)
    if legacy.before_task_records(rec):
        return
    if rec.get("fingerprint") != fingerprint:
        raise ValueError(
            f"the problems of task {spec!r} differ from those {run.path} was trained on "
            f"(fingerprint mismatch); resume needs the same task and data"
        )


def _check_prompt_log(cfg: ESConfig, run, pool: int) -> None:
    """Every logged iteration's prompt indices must be what the config derives (see module doc)."""
    for rec in run.iterations():
        if not legacy.before_prompt_logs(rec) and rec["prompt_indices"] != prompt_indices(cfg, rec["iteration"], pool):
            raise ValueError(
                f"{run.path}: the prompts logged for iteration {rec['iteration']} differ from the ones "
                f"prompt_sampler={cfg.prompt_sampler!r} derives here (Python's random module changed?); "
                f"the run cannot continue identically (replay still rebuilds its weights)"
            )


def finish_iteration(run, evaluator, eval_task, t: int, hook: Callable[[int, str], None] | None = None):
    """Do what iteration t's bookkeeping still lacks: its held-out evaluation and its checkpoint, when the
    config has them at t.  On resume at t this finishes an iteration a kill cut short.  Returns the
    eval record it wrote, or None."""
    cfg, T = run.cfg, run.cfg.iterations
    rec = None
    due_eval = t in (0, T) or (cfg.eval_every and t % cfg.eval_every == 0)
    if (
        eval_task is not None
        and due_eval
        and not any(r.get("kind") == "eval" and r.get("iteration") == t for r in run.records)
    ):
        rec = evaluate_heldout(run, evaluator, eval_task, t)
    due_ck = t > 0 and (t == T or (cfg.checkpoint_every and t % cfg.checkpoint_every == 0))
    if due_ck and run.checkpoint_iteration() != t:
        run.checkpoint(evaluator, t)
        if hook:
            hook(t, "checkpointed")
    return rec


def evaluate_heldout(run, evaluator, task, t: int) -> dict:
    """Mean reward of the center θ_t on the held-out problems; logged as an ``eval`` record."""
    from espert.runs import kill_point

    t0 = time.time()
    rewards = evaluator.evaluate_center(task.prompts, task.answers)
    kill_point("evaluated", t)
    rec = {
        "kind": "eval",
        "iteration": t,
        "mean": sum(rewards) / len(rewards) if rewards else None,
        "n": len(rewards),
        # the policy's token entropy (the second seed paper's Figure 2: GRPO's falls, ES's stays flat)
        "token_entropy": evaluator.last_token_entropy,
        "seconds": round(time.time() - t0, 4),
        "time": time.time(),
    }
    run.append(rec)
    return rec


def heldout_metrics(rec: dict) -> dict:
    """The scalar metrics of an ``eval`` record (what trackers receive)."""
    keys = {"mean": "heldout/mean", "token_entropy": "heldout/token_entropy"}
    return {name: rec[k] for k, name in keys.items() if rec.get(k) is not None}


def iteration_metrics(rec: dict) -> dict:
    """The scalar metrics of an ``iter`` record (what trackers receive)."""
    m = {f"reward/{k}": v for k, v in rec["reward"].items() if v is not None}
    m.update({k: rec[k] for k in ("sigma", "alpha", "step_norm", "eval_seconds") if rec.get(k) is not None})
    if "zero_spread" in rec:
        m["reward/zero_spread"] = float(rec["zero_spread"])
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
    stop: Callable[[], bool] | None = None,
) -> dict:
    """Train (or resume) a run in ``run_dir``; returns a summary dict
    ``{"run_dir", "iterations", "heldout": [(t, mean)], "train_reward": [(t, mean)], "export", "stopped"}``.

    cfg: the run's config; with ``resume`` it may be None (use the stored one) or must match the
    stored one except for ``runs.RESUMABLE_CHANGES``.  echo: where status lines go (None: nowhere).
    task / reward / prompts / eval_prompts: a custom task (see :func:`resolve_tasks`); its import
    path (or name) is recorded as ``task`` in config.yaml, and a resume resolves it again.

    hook(t, phase) is called at phases ``"logged"`` (record appended, update not yet applied),
    ``"updated"`` and ``"checkpointed"`` of each iteration; tests use it to crash a run anywhere.

    stop() is asked before each iteration; when it says True the run ends there (each finished
    iteration is logged, with its checkpoint when one was due) and the summary's ``"stopped"`` is that
    iteration.  The CLI asks it on SIGTERM and SIGINT.
    """
    import torch

    from espert import runs

    cfg, tasks = _inputs(cfg, run_dir, resume, task, reward, prompts, eval_prompts)
    run = runs.Run.open(run_dir, tasks.cfg_of(cfg), resume=resume, echo=echo)
    threads = torch.get_num_threads()
    if run.cfg.cpu_threads:
        torch.set_num_threads(run.cfg.cpu_threads)
    loop = TrainingLoop(run, tasks, hook, echo)
    try:
        start, T = loop.setup(resume), run.cfg.iterations  # task record, evaluator, center, trackers
        if run.cfg.method == "randopt":  # no iterations: members scored once, the ensemble kept
            return {**run.summary(), **train_randopt(run, tasks.train, loop.evaluator, echo, stop)}
        bar = _progress(progress, T, start)
        stopped = None
        for t in range(start + 1, T + 1):
            if stop is not None and stop():  # between iterations: the log and checkpoints are complete here
                stopped = t - 1
                break
            rec = loop.step(t)  # perturb -> evaluate every member -> log ahead -> update
            loop.after_step(t, rec, bar)  # trackers, warnings, held-out evaluation and checkpoint when due
        if bar is not None:
            bar.close()
        if stopped is None:
            loop.finish()
        return {**run.summary(), "stopped": stopped}
    finally:
        loop.close()
        run.close()
        torch.set_num_threads(threads)


@dataclasses.dataclass
class Tasks:
    """A run's resolved task: its spec (what config.yaml records), where it came from, the training and
    held-out problems, and their fingerprint."""

    spec: str
    source: str
    train: Any
    heldout: Any
    fingerprint: str

    def cfg_of(self, cfg: ESConfig) -> ESConfig:
        return cfg if self.spec == cfg.task else dataclasses.replace(cfg, task=self.spec)


def _inputs(cfg, run_dir: str, resume: bool, task, reward, prompts, eval_prompts) -> tuple[ESConfig, Tasks]:
    """The config (the stored one when resuming without one) and the task, checked before anything is written."""
    if resume and cfg is None:
        cfg = _stored_config(run_dir)
    if resume and task is None and reward is None:
        _refuse_python_task(run_dir)
    if cfg is None:
        raise ValueError("a new run needs a config (cfg=None is only for resuming)")
    check_config(cfg)  # a missing optional package: one line now, not a traceback mid-run
    if cfg.evaluator == "vllm":
        from espert.vllm.patches import require_vllm

        require_vllm("--evaluator vllm")  # and a vLLM espert's version gate takes (espert/vllm/patches)
    spec, source, train_task, eval_task = resolve_tasks(cfg, task, reward, prompts, eval_prompts)
    return cfg, Tasks(spec, source, train_task, eval_task, task_fingerprint(train_task, eval_task))


class TrainingLoop:
    """One run's loop state between :func:`train`'s steps: the run, its tasks, the evaluator, the
    diagnostics meter and the trackers (:meth:`setup` builds them; :meth:`close` releases what it built)."""

    def __init__(self, run, tasks: Tasks, hook, echo):
        self.run, self.tasks, self.hook = run, tasks, hook
        self.cfg, self.say = run.cfg, echo or (lambda s: None)
        self.evaluator = self.trackers = None
        self.flat, self.warned_flat = 0, False  # consecutive iterations with zero reward spread; warned once

    def setup(self, resume: bool) -> int:
        """Check a resume against the log, record the task, build the evaluator, commit the run directory,
        restore the center; returns the iteration to continue from."""
        from espert.tasks.rewards import answer_equivalence
        from espert.tracking import Trackers

        run, tasks = self.run, self.tasks
        if resume:
            _check_task_record(run, tasks.spec, tasks.fingerprint)
            _check_prompt_log(self.cfg, run, len(tasks.train))
        self._record_task()
        self.evaluator = _build_evaluator(run, tasks.train, resume)
        _check_exportable(run, self.evaluator, resume)
        run.commit()  # everything loaded: only now does the run directory appear
        self.evaluator.base_moved(run.base_path)
        self._say_unmoved()
        self.energy = self.evaluator.noise_energy()
        self.meter = IterationMeter(self.evaluator, run.iterations(), answer_equivalence(tasks.train.name))
        start = run.restore(self.evaluator)
        if start > self.cfg.iterations:
            raise ValueError(
                f"{run.path} already logged {start} iterations, more than iterations={self.cfg.iterations}"
            )
        if resume and start < self.cfg.iterations:  # when a process took over (the training curve marks it)
            run.append({"kind": "resume", "iteration": start, "time": time.time()})
        self.trackers = Trackers(self.cfg.trackers, run.path, self.cfg.tracker_project, self.cfg.to_dict(), self.say)
        self._finish_iteration(start)  # its evaluation and checkpoint, if a kill cut them off (or the base's)
        return start

    def step(self, t: int) -> dict:
        """Iteration t: es_step over the iteration's prompts; the record is logged before the update."""
        idx = prompt_indices(self.cfg, t, len(self.tasks.train))
        self.meter.start()
        train = self.tasks.train
        rec = es_step(
            self.evaluator,
            self.cfg,
            t,
            [train.prompts[i] for i in idx],
            [train.answers[i] for i in idx],
            functools.partial(self._write_ahead, idx),
            noise_energy=self.energy,
        )
        if self.hook:
            self.hook(t, "updated")
        return rec

    def _write_ahead(self, idx: list[int], rec: dict) -> None:
        """The iteration's record, appended to the log before its update is applied (resume replays it)."""
        rec["prompt_indices"] = idx
        rec["time"] = time.time()
        rec["diagnostics"] = self.meter(rec)  # Corr(X+,X-), kappa, reward spread, answer JS, cumulative FLOPs
        self.run.append(rec)
        if self.hook:
            self.hook(rec["iteration"], "logged")

    def after_step(self, t: int, rec: dict, bar) -> None:
        """Metrics to the trackers, the skipped and zero-spread warnings, held-out evaluation and checkpoint
        when due, and the progress bar."""
        self.trackers.log(iteration_metrics(rec), t)
        if rec["skipped"]:
            self.say(f"[espert] iteration {t}: every member failed; update skipped")
        self._watch_spread(t, rec)
        self._finish_iteration(t)
        if bar is not None:
            last_eval = self.run.last_eval()
            bar.set_postfix(bar_postfix(rec, None if last_eval is None else last_eval["mean"]), refresh=False)
            bar.update(1)

    def _watch_spread(self, t: int, rec: dict) -> None:
        """Warn once when two iterations in a row had zero reward spread (no step was taken)."""
        self.flat = self.flat + 1 if rec.get("zero_spread") else 0
        if self.flat == 2 and not self.warned_flat:
            self.warned_flat = True
            self.say(
                f"[espert] iterations {t - 1}-{t}: zero reward spread (every member got the same reward), so "
                f"no step was taken; usually sigma={rec['sigma']:g} (sigma_mode {self.cfg.sigma_mode}) is too small "
                f"to change any completion: raise --sigma, or use --sigma-mode rms"
            )

    def _finish_iteration(self, t: int) -> None:
        ev = finish_iteration(self.run, self.evaluator, self.tasks.heldout, t, self.hook)
        if ev is not None:
            self.trackers.log(heldout_metrics(ev), t)

    def finish(self) -> None:
        """The final checkpoint, when the last iteration has none yet (e.g. iterations: 0)."""
        T = self.cfg.iterations
        if self.run.checkpoint_iteration() != T:
            self.run.checkpoint(self.evaluator, T)
            if self.hook:
                self.hook(T, "checkpointed")

    def _record_task(self) -> None:
        """The task record, once, before the first iteration (resume checks against it)."""
        tasks = self.tasks
        if _task_record(self.run.records) is None and not self.run.iterations():
            self.run.append(
                {
                    "kind": "task",
                    "spec": tasks.spec,
                    "source": tasks.source,
                    "fingerprint": tasks.fingerprint,
                    "n_train": len(tasks.train),
                    "n_eval": None if tasks.heldout is None else len(tasks.heldout),
                }
            )
        if tasks.heldout is None and self.cfg.eval_size:
            self.say(
                f"[espert] task {tasks.spec!r} has no held-out problems (give eval_data or eval_prompts); "
                f"held-out evaluation is off"
            )

    def _say_unmoved(self) -> None:
        unmoved = getattr(self.evaluator, "unmoved", None)
        if unmoved:  # vllm_members: batched (config.yaml records the mode; docs/vllm.md says what stays)
            self.say(
                f"[espert] vllm_members batched: {len(unmoved)} tensors stay at the base (no LoRA slot carries "
                f"them: embeddings, lm_head, norms, biases), e.g. {', '.join(unmoved[:3])}"
            )

    def close(self) -> None:
        if self.trackers is not None:
            self.trackers.close()
        if self.evaluator is not None:
            self.evaluator.close()


def train_randopt(run, train_task, evaluator, echo=print, stop: Callable[[], bool] | None = None) -> dict:
    """``method: randopt`` (:mod:`espert.randopt`): score the members the log does not hold yet, a window at a
    time (each window's records logged before the next is evaluated), then log the ensemble and write
    ``RUN/ensemble.json``.  Returns ``{"members", "ensemble": [(seed, σ)] | None, "stopped"}`` (``stopped``:
    the members scored when ``stop()`` ended the run early, else None)."""
    import json

    from espert.files import atomic_write_text
    from espert.randopt import ENSEMBLE, WINDOW, ensemble_doc, score_members

    cfg, say = run.cfg, echo or (lambda s: None)
    idx = prompt_indices(cfg, 1, len(train_task))
    prompts, answers = [train_task.prompts[i] for i in idx], [train_task.answers[i] for i in idx]
    done = {r["k"]: r for r in run.records if r.get("kind") == "member"}
    todo = [k for k in range(cfg.population) if k not in done]
    for i in range(0, len(todo), WINDOW):
        if stop is not None and stop():
            return {"members": len(done), "ensemble": None, "stopped": len(done)}
        for rec in score_members(evaluator, cfg, todo[i : i + WINDOW], prompts, answers):
            run.append({**rec, "time": time.time()})
            done[rec["k"]] = rec
        best = max((r["reward"] for r in done.values() if r["reward"] is not None), default=None)
        say(f"[espert] randopt: {len(done)}/{cfg.population} members scored, best training reward {best}")
    doc = ensemble_doc(cfg, run.doc["base_model"], [done[k] for k in range(cfg.population)], len(idx))
    if not any(r.get("kind") == "ensemble" for r in run.records):
        run.append({"kind": "ensemble", "members": doc["members"], "time": time.time()})
    atomic_write_text(run.file(ENSEMBLE), json.dumps(doc, indent=2) + "\n")
    say(f"[espert] randopt: ensemble of {len(doc['members'])} members -> {run.file(ENSEMBLE)}")
    return {"members": len(done), "ensemble": [(m["seed"], m["sigma"]) for m in doc["members"]], "stopped": None}


def _build_evaluator(run, train_task, resume: bool):
    """The config's evaluator over the run's base model; a model it cannot load is one ValueError."""
    from espert.evaluators import build_evaluator, loading_model
    from espert.progress import ticking

    cfg = run.cfg
    what = cfg.model if cfg.model != "tiny" else run.base_path
    note = "" if resume else "; nothing was written, so the same command works once it is fixed"
    with loading_model(what, cfg.evaluator, note), ticking(f"[espert] loading the model ({cfg.evaluator} evaluator)"):
        return build_evaluator(cfg, run.base_path, train_task.score, train_task.extract)


def _check_exportable(run, evaluator, resume: bool) -> None:
    """Refuse, before the first iteration, a run whose export in the base's format could not be written."""
    from espert.runs.export import check_exportable

    try:
        check_exportable(evaluator.export_layout(), run.base_path)
    except ValueError as e:
        raise ValueError(f"{e}{'' if resume else '; the run was not started and nothing was written'}") from None


def bar_postfix(rec: dict, heldout: float | None) -> dict[str, str]:
    """The progress bar's fields after an iteration: reward mean and std, the last held-out mean, and
    ``step: none (zero spread)`` when every member got the same reward."""
    post = {"r_mean": rec["reward"]["mean"], "r_std": rec["reward"]["std"]}
    if heldout is not None:
        post["heldout"] = heldout
    out = {k: ("nan" if v is None or not math.isfinite(v) else f"{v:.3f}") for k, v in post.items()}
    if rec.get("zero_spread"):
        out["step"] = "none (zero spread)"
    return out


def _progress(enabled: bool, total: int, initial: int):
    """The iterations' bar, on a terminal only (:mod:`espert.progress`): a log keeps the status lines."""
    from espert.progress import shown

    if not (enabled and shown()):
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="espert train", unit="it", dynamic_ncols=True)


__all__ = ["train", "resolve_tasks", "task_fingerprint", "iteration_metrics", "finish_iteration", "evaluate_heldout"]
