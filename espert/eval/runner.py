"""Generate samples for several models, score them, and write the report and plots."""

from __future__ import annotations

import json
import os
import re
import time
from typing import Callable, Optional, Sequence

from ..tasks import Task
from .plots import write_plots
from .report import build_report, format_summary
from .samples import group_by_model, load_samples, make_records, rescore

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


def generate_samples(task: Task, label: str, sampler, n: int, temperature: float, top_p: float, max_tokens: int,
                     seed: int, extra_meta: Optional[dict] = None) -> list[dict]:
    """Sample ``n`` completions per problem with ``sampler`` and score them into records."""
    if len(task) == 0:
        raise ValueError(f"task {task.name!r} has no problems")
    t0 = time.time()
    comps = sampler.sample(task.prompts, n, temperature, top_p, max_tokens, seed)
    if len(comps) != len(task) or any(len(c) != n for c in comps):
        raise RuntimeError("sampler returned the wrong number of completions")
    meta = {"n": n, "temperature": temperature, "top_p": top_p, "max_tokens": max_tokens, "seed": seed,
            "sampling_seconds": round(time.time() - t0, 3)}
    meta.update(extra_meta or {})
    return make_records(label, task, comps, meta=meta)


def write_outputs(groups: dict[str, list[dict]], out_dir: str, base: Optional[str], threshold: float,
                  solve_rule: str, plots: bool = True, echo: Callable[[str], None] = print,
                  maj_method: str = "subsets") -> dict:
    """Build the report from grouped records and write ``report.json``, ``summary.txt`` and PNGs."""
    report = build_report(groups, base=base, threshold=threshold, solve_rule=solve_rule, maj_method=maj_method)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, sort_keys=False)
        f.write("\n")
    summary = format_summary(report)
    with open(os.path.join(out_dir, "summary.txt"), "w", encoding="utf-8") as f:
        f.write(summary + "\n")
    if plots:
        write_plots(report, out_dir)
    echo(summary)
    return report


def load_sample_files(paths: Sequence[str], task_name: Optional[str] = None, rescore_rewards: bool = True
                      ) -> dict[str, list[dict]]:
    """Load saved sample files, optionally re-score them, and group them by model label."""
    if not paths:
        raise ValueError("no sample files given")
    records: list[dict] = []
    for p in paths:
        records.extend(load_samples(p))
    groups = group_by_model(records)
    if rescore_rewards:
        for recs in groups.values():
            rescore(recs, task_name)
    return groups
