"""Saving, loading and (re)scoring sampled completions (one JSONL line per problem)."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable, Optional, Sequence

from ..tasks import Task, reward_task
from ..tasks.loaders import iter_jsonl

#: Keys of one JSONL line.
RECORD_KEYS = ("model", "task", "index", "prompt", "answer", "completions", "rewards", "statuses", "extracted", "meta")


def make_records(
    label: str, task: Task, completions: Sequence[Sequence[str]], meta: Optional[dict] = None
) -> list[dict]:
    """Score completions (``completions[i]`` = the n samples of problem i) into records.

    Each record holds the model label, task name, problem index, prompt, answer, the
    completions, per-sample rewards, for code tasks each check's status (``statuses``: passed, failed,
    timeout, output_limit), extracted answers, and ``meta`` (sampling settings).
    """
    if len(completions) != len(task.prompts):
        raise ValueError(f"got completions for {len(completions)} problems, task has {len(task.prompts)}")
    records = [
        {"model": label, "task": task.name, "index": i, "prompt": p, "answer": a, "completions": list(comps)}
        | {"rewards": [], "extracted": [], "meta": dict(meta or {})}
        for i, (p, a, comps) in enumerate(zip(task.prompts, task.answers, completions))
    ]
    return score_records(records, task)


def score_records(records: list[dict], task: Task) -> list[dict]:
    """(Re)compute ``rewards`` and ``extracted`` of every record in place with ``task``'s reward.

    All completions are scored in one batched call. Returns ``records``.
    """
    flat_c, flat_a = [], []
    for r in records:
        if not r["completions"]:
            raise ValueError(f"model {r['model']!r} problem {r['index']}: empty completion list")
        flat_c.extend(r["completions"])
        flat_a.extend([r["answer"]] * len(r["completions"]))
    rewards, statuses = task.score_with_status(flat_c, flat_a)
    pos = 0
    for r in records:
        m = len(r["completions"])
        r["rewards"] = rewards[pos : pos + m]
        if statuses is not None:  # a code task: a timeout is told apart from a wrong answer
            r["statuses"] = statuses[pos : pos + m]
        else:
            r.pop("statuses", None)
        r["extracted"] = [task.extract(c, r["answer"]) for c in r["completions"]]
        r["task"] = task.name
        pos += m
    return records


def save_samples(path: str, records: Iterable[dict]) -> None:
    """Write records as JSONL (one problem per line, UTF-8, keys in a fixed order)."""
    from espert.files import atomic_write_text  # whole or not at all (a full disk keeps the old file)

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    lines = (json.dumps({k: r[k] for k in RECORD_KEYS if k in r}, ensure_ascii=False) + "\n" for r in records)
    atomic_write_text(path, "".join(lines))


def validate_record(r: Any, where: str) -> dict:
    """Check one loaded record; raises ``ValueError`` naming ``where`` on any problem."""
    if not isinstance(r, dict):
        raise ValueError(f"{where}: expected a JSON object")
    for k in ("model", "index", "prompt", "answer", "completions", "rewards", "extracted"):
        if k not in r:
            raise ValueError(f"{where}: missing key {k!r}")
    comps, rews, ext = r["completions"], r["rewards"], r["extracted"]
    if not isinstance(comps, list) or not comps:
        raise ValueError(f"{where}: 'completions' must be a non-empty list")
    for got, what in ((rews, "rewards"), (ext, "extracted answers")):
        if not isinstance(got, list) or len(got) != len(comps):
            n = len(got) if isinstance(got, list) else "?"
            raise ValueError(f"{where}: {len(comps)} completions but {n} {what}")
    for j, x in enumerate(rews):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or math.isnan(x) or math.isinf(x):
            raise ValueError(f"{where}: reward {j} is not a finite number ({x!r})")
        if not 0.0 <= x <= 1.0:
            raise ValueError(f"{where}: reward {j} = {x} is outside [0, 1]")
    for j, x in enumerate(ext):
        if x is not None and not isinstance(x, str):
            raise ValueError(f"{where}: extracted answer {j} must be a string or null")
    st = r.get("statuses")
    if st is not None and (
        not isinstance(st, list) or len(st) != len(comps) or not all(isinstance(x, str) for x in st)
    ):
        raise ValueError(f"{where}: 'statuses' must be one string per completion")
    r.setdefault("task", None)
    r.setdefault("meta", {})
    return r


def load_samples(path: str) -> list[dict]:
    """Read a samples JSONL file written by :func:`save_samples` (validated)."""
    out = [validate_record(r, where) for where, r in iter_jsonl(path, "samples file")]
    if not out:
        raise ValueError(f"samples file {path} contains no records")
    return out


def group_by_model(records: Iterable[dict]) -> dict[str, list[dict]]:
    """Group records by model label (insertion order), sorted by problem index; duplicate indices are an error."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(str(r["model"]), []).append(r)
    for label, recs in groups.items():
        recs.sort(key=lambda r: r["index"])
        for a, b in zip(recs, recs[1:]):  # sorted: a repeated index is a neighbour
            if a["index"] == b["index"]:
                raise ValueError(f"model {label!r}: problem index {b['index']} appears more than once")
    return groups


def rescore(records: list[dict], task_name: Optional[str] = None) -> list[dict]:
    """Recompute rewards/extracted answers of loaded records with a built-in task's reward.

    ``task_name`` defaults to the ``task`` stored in the records (all must agree).
    """
    if task_name is None:
        names = {r.get("task") for r in records}
        if len(names) != 1 or None in names:
            raise ValueError(f"cannot infer the task from the samples (found {sorted(map(str, names))}); pass --task")
        task_name = names.pop()
    return score_records(records, reward_task(task_name))
