"""Generate samples for several models, score them, and write the report and plots."""

from __future__ import annotations

import inspect
import json
import os
import re
import time
from typing import Callable, Optional, Sequence

from espert.extras import have, install_hint
from espert.progress import bar, shown, ticking

from ..tasks import PYTHON_PREFIX, Task, load_spec_task
from .plots import write_plots
from .report import build_report, format_summary
from .samplers import TransformersSampler
from .samples import group_by_model, load_samples, make_records, rescore, save_samples

_LABEL_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


def parse_model_specs(specs: Sequence[str]) -> dict[str, str]:
    """Parse ``label=path`` strings (a bare path gets its directory name as label)."""
    models: dict[str, str] = {}
    for spec in specs:
        if "=" in spec:
            label, path = spec.split("=", 1)
        else:
            path = spec
            label = os.path.basename(os.path.normpath(spec))
        if not label or not _LABEL_RE.match(label):
            raise ValueError(f"bad model label {label!r} in {spec!r}: use letters, digits, '_', '-', '.'")
        if not path:
            raise ValueError(f"empty model path in {spec!r}")
        if label in models:
            raise ValueError(f"model label {label!r} given twice")
        models[label] = path
    if not models:
        raise ValueError("no models given")
    return models


def generate_samples(
    task: Task,
    label: str,
    sampler,
    n: int,
    temperature: float,
    top_p: float,
    max_tokens: int,
    seed: int,
    extra_meta: Optional[dict] = None,
    progress: Optional[str] = None,
) -> list[dict]:
    """Sample ``n`` completions per problem with ``sampler`` and score them into records.

    progress: the title of a bar counting the problems sampled (on a terminal only, :mod:`espert.progress`),
    for samplers that report it (a ``progress`` callback); else a line counting the seconds."""
    if len(task) == 0:
        raise ValueError(f"task {task.name!r} has no problems")
    t0 = time.time()
    on = progress is not None and shown()
    counted = on and "progress" in inspect.signature(sampler.sample).parameters
    with bar(progress or "", len(task), "problem", counted) as done, ticking(progress or "", on and not counted):
        kwargs = {"progress": done.update} if counted else {}
        comps = sampler.sample(task.prompts, n, temperature, top_p, max_tokens, seed, **kwargs)
    if len(comps) != len(task) or any(len(c) != n for c in comps):
        raise RuntimeError("sampler returned the wrong number of completions")
    meta = dict(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed)
    meta = {**meta, "sampling_seconds": round(time.time() - t0, 3), **(extra_meta or {})}
    return make_records(label, task, comps, meta=meta)


def write_outputs(
    groups: dict[str, list[dict]],
    out_dir: str,
    base: Optional[str],
    threshold: float,
    solve_rule: str,
    plots: bool = True,
    echo: Callable[[str], None] = print,
    maj_method: str = "subsets",
) -> dict:
    """Build the report from grouped records and write ``report.json``, ``summary.txt`` and PNGs."""
    report = build_report(groups, base=base, threshold=threshold, solve_rule=solve_rule, maj_method=maj_method)
    os.makedirs(out_dir, exist_ok=True)
    from espert.files import atomic_write_text  # (lazy: espert.runs imports torch; --help must not)

    # each file whole or not at all (a full disk leaves the previous one untouched)
    atomic_write_text(os.path.join(out_dir, "report.json"), json.dumps(report, indent=2, sort_keys=False) + "\n")
    summary = format_summary(report)
    atomic_write_text(os.path.join(out_dir, "summary.txt"), summary + "\n")
    echo(summary)
    if plots and not have("matplotlib"):  # the report is complete without its pictures
        echo(f"[espert] plots skipped: {install_hint('matplotlib')}")
    elif plots:
        write_plots(report, out_dir)
    return report


def load_sample_files(
    paths: Sequence[str], task_name: Optional[str] = None, rescore_rewards: bool = True
) -> dict[str, list[dict]]:
    """Load saved sample files, optionally re-score them, and group them by model label."""
    if not paths:
        raise ValueError("no sample files given")
    groups = group_by_model(r for p in paths for r in load_samples(p))
    if rescore_rewards:
        for recs in groups.values():
            rescore(recs, task_name)
    return groups


def _heldout_task(cfg: dict, limit: int) -> Task:
    """The held-out problems of a run's config (its ``eval_split`` / ``eval_data``)."""
    if str(cfg["task"]).startswith(PYTHON_PREFIX):
        raise ValueError(f"run task {cfg['task']!r} was given as Python objects: pass it as task=")
    task = load_spec_task(cfg["task"], cfg.get("eval_split", "test"), n=limit, path=cfg.get("eval_data"))
    if task is None:
        raise ValueError(f"run task {cfg['task']!r} has no held-out problems (eval_data)")
    return task


def evaluate_run(
    run_dir: str,
    n: int = 16,
    limit: int = 64,
    temperature: float = 1.0,
    seed: int = 0,
    out_dir: Optional[str] = None,
    task: Optional[Task] = None,
    plots: bool = True,
    echo: Callable[[str], None] = print,
) -> dict:
    """pass@k / maj@k report of a training run's base model against its final export.

    Samples ``n`` completions (``temperature``, top-p 1) for the first ``limit`` held-out problems
    of the run's task (its ``eval_split`` / ``eval_data``; a custom task must be given as ``task``)
    from ``RUN/base_model`` (or the run's base reference) labelled ``base`` and from ``RUN/export``
    labelled ``es``, and writes ``report.json``, ``summary.txt``, the samples and the plots to
    ``out_dir`` (default ``RUN/eval``).  Returns the report.
    """
    from ..runs import BASE, EXPORT, read_run_config

    doc = read_run_config(run_dir)
    cfg = doc["config"]
    base = os.path.join(run_dir, BASE) if doc["base_model"] == BASE else doc["base_model"]
    export = os.path.join(run_dir, EXPORT)
    if not os.path.isdir(export):
        raise FileNotFoundError(f"{run_dir} has no final export ({EXPORT}/): train it to the end first")
    task = (task or _heldout_task(cfg, limit)).subset(limit)
    out_dir = out_dir or os.path.join(run_dir, "eval")
    os.makedirs(out_dir, exist_ok=True)
    groups, sampling = {}, (n, temperature, 1.0, int(cfg["max_new_tokens"]), seed)
    for label, path in (("base", base), ("es", export)):
        with ticking(f"[espert] report: loading {label}"):
            sampler = TransformersSampler(
                path, device="cpu", batch_size=256, chat_template=bool(cfg.get("chat_template"))
            )
        title = f"[espert] report: sampling {label}"
        recs = generate_samples(task, label, sampler, *sampling, extra_meta={"model_path": path}, progress=title)
        save_samples(os.path.join(out_dir, f"samples_{label}.jsonl"), recs)
        groups[label] = recs
    return write_outputs(
        groups, out_dir, base="base", threshold=task.success_threshold, solve_rule="any", plots=plots, echo=echo
    )
