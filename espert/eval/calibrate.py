"""``espert calibrate``: a base model's reward on each level of a generated task's ladder, and the level to train on.

ES learns from the spread of rewards between members: a task the base always solves (a 0.5 B instruct
model scores 1.0 on two-digit additions) or never solves gives every member the same reward and no step.
The generated tasks have difficulty ladders (``arithmetic@L``, ``countdown@L``: :mod:`espert.tasks.generated`);
this command samples the base greedily on the held-out problems of each level and picks the first level
whose mean reward falls in [0.1, 0.7] (:func:`pick_level`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from espert.extras import require
from espert.tasks import canonical_task_name, load_task
from espert.tasks.generated import LEVELS, level_knobs

from .samplers import make_sampler

#: The base reward a level must have to be picked: inside this range ES members' rewards differ.
LOW, HIGH = 0.1, 0.7
#: Default generation budget per task (a Countdown answer comes after its reasoning).
MAX_NEW_TOKENS = {"arithmetic": 16, "countdown": 192, "countdown_format": 192}


def pick_level(rewards: dict[int, float], low: float = LOW, high: float = HIGH) -> int | None:
    """The first level (in level order) whose reward lies in ``[low, high]``; None when none does."""
    return next((level for level in sorted(rewards) if low <= rewards[level] <= high), None)


def describe_level(task: str, level: int) -> str:
    """A level's knobs in words: ``"2-digit * , 2 terms"`` or ``"3-4 numbers in 1..99, target <= 999"``."""
    k = level_knobs(task, level)
    if task == "arithmetic":
        return f"{k['digits']}-digit {' '.join(k['ops'])}, {k['terms']} terms"
    lo, hi = k["min_numbers"], k["max_numbers"]
    return f"{lo if lo == hi else f'{lo}-{hi}'} numbers in 1..{k['max_number']}, target <= {k['max_target']}"


def calibrate(sampler, task: str, levels: list[int], n: int, max_new_tokens: int, echo=None) -> dict:
    """Greedy base rewards of ``sampler`` (a :class:`espert.eval.samplers.Sampler`) on ``n`` held-out problems of
    each level of ``task``; returns ``{"task", "levels": [{"level", "knobs", "problems", "reward",
    "seconds"}], "pick"}``.  Every level's problems are generated before the first sample."""
    problems = {level: load_task(f"{task}@{level}", "test", n=n) for level in levels}
    rows = []
    for level, t in problems.items():
        t0 = time.perf_counter()
        samples = sampler.sample(t.prompts, n=1, temperature=0.0, top_p=1.0, max_tokens=max_new_tokens, seed=0)
        rewards = t.score([s[0] for s in samples], t.answers)
        row = {"level": level, "knobs": describe_level(t.name, level), "problems": len(t)}
        row.update(reward=sum(rewards) / len(rewards), seconds=round(time.perf_counter() - t0, 2))
        rows.append(row)
        if echo:
            echo(f"[espert calibrate] {task}@{level}: reward {row['reward']:.3f} ({row['seconds']} s)")
    pick = pick_level({r["level"]: r["reward"] for r in rows})
    return {"task": task, "levels": rows, "pick": pick, "range": [LOW, HIGH]}


def format_report(doc: dict, model: str) -> str:
    """The table and the verdict ``espert calibrate`` prints."""
    task = doc["task"]
    lines = [f"{'level':<22}{'knobs':<40}{'problems':>9}{'reward':>9}{'seconds':>9}"]
    for r in doc["levels"]:
        name = f"{task}@{r['level']}"
        lines.append(f"{name:<22}{r['knobs']:<40}{r['problems']:>9}{r['reward']:>9.3f}{r['seconds']:>9.1f}")
    low, high = doc["range"]
    if doc["pick"] is None:
        rewards = [r["reward"] for r in doc["levels"]]
        side = "all above it: the base solves them" if min(rewards) > high else "none inside it"
        lines.append(f"no level has a base reward in [{low}, {high}] ({side}); ES gets no reward spread there")
    else:
        r = next(r for r in doc["levels"] if r["level"] == doc["pick"])
        lines.append(
            f"first level with a base reward in [{low}, {high}]: {task}@{doc['pick']} ({r['reward']:.3f}); "
            f"train on it: espert train --model {model} --task {task}@{doc['pick']}"
        )
    return "\n".join(lines)


def add_calibrate_parser(sub) -> None:
    """The ``calibrate`` subcommand."""
    p = sub.add_parser(
        "calibrate",
        help="a base model's reward per difficulty level of a generated task, and the level to train on",
        description="Greedy-sample the base model on held-out problems of each level of a generated task "
        "(arithmetic@L, countdown@L) and pick the first level whose mean reward is in [0.1, 0.7], where ES "
        "members' rewards differ.",
    )
    p.add_argument("--model", required=True, help="a model directory, Hub id, GGUF file or smollm2-135m-instruct")
    p.add_argument("--task", required=True, help="arithmetic, countdown or countdown_format")
    p.add_argument("--levels", default=None, help="comma-separated levels to try (default: every level)")
    p.add_argument("--limit", type=int, default=32, help="held-out problems per level (default: 32)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: 16 (arithmetic), 192 (countdown)")
    p.add_argument("--evaluator", choices=("torch", "vllm"), default="torch", help="sampler (default: torch)")
    p.add_argument("--chat-template", action="store_true", help="wrap prompts in the tokenizer's chat template")
    p.add_argument("--dtype", default="auto", help="model dtype (default auto: as espert eval)")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    p.set_defaults(func=cmd_calibrate)


def _levels(task: str, spec: str | None) -> list[int]:
    if task not in LEVELS:
        level_knobs(task, 1)  # the one-line refusal for a task without a ladder
    if spec is None:
        return list(range(1, len(LEVELS[task]) + 1))
    try:
        levels = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--levels takes whole numbers separated by commas, got {spec!r}") from None
    for level in levels:
        level_knobs(task, level)
    return levels


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Entry point of ``espert calibrate`` (bad input: the CLI's one line, exit 2, before the model loads)."""
    from espert.runs import resolve_model_dir
    from espert.runs.gguf import gguf_path

    task = canonical_task_name(args.task)
    levels = _levels(task, args.levels)
    if args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    if args.evaluator == "vllm":
        require("vllm", "--evaluator vllm")
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    path = resolve_model_dir(gguf_path(args.model) or args.model, say)
    kwargs = dict(chat_template=args.chat_template, dtype=args.dtype)
    if args.evaluator == "torch":
        kwargs["device"] = "cpu"
    sampler = make_sampler(args.evaluator, path, **kwargs)
    try:
        doc = calibrate(sampler, task, levels, args.limit, args.max_new_tokens or MAX_NEW_TOKENS[task], say)
    finally:
        sampler.close()
    doc["model"] = args.model
    print(format_report(doc, args.model))
    if args.json:
        from espert.files import atomic_write_text

        atomic_write_text(args.json, json.dumps(doc, indent=2) + "\n")
    return 0
