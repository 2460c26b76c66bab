"""Tasks and rewards used by the ES trainer and by ``espert eval``.

Public API::

    from espert.tasks import Task, load_task, make_task, reward_task, known_tasks

    task = load_task("copy", "train", n=256)   # or arithmetic, countdown, humaneval, mbpp, gsm8k, ...
    rewards = task.score(completions, task.answers)   # list[float] in [0, 1]
    answer = task.extract(completion, task.answers[0])  # str | None
"""

from espert.jail.sandbox import Check

from .base import Task, check_rewards, make_task, per_item_reward
from .code import code_extract, code_reward, humaneval_reward, mbpp_reward
from .copy_task import make_copy_task
from .generated import COUNTDOWN_PROMPT, make_arithmetic_task, make_countdown_task
from .loaders import (
    GSM8K_PROMPT,
    MATH_PROMPT,
    load_humaneval,
    load_jsonl_task,
    load_task,
    reward_task,
)
from .resolve import PYTHON_PREFIX, TASK_SOURCES, load_spec_task, resolve_tasks, task_fingerprint
from .rewards import (
    arithmetic_extract,
    arithmetic_reward,
    canonical_task_name,
    copy_extract,
    copy_reward,
    countdown_answer,
    countdown_check,
    countdown_evaluate,
    countdown_extract,
    countdown_format_reward,
    countdown_reward,
    gsm8k_extract,
    gsm8k_reward,
    known_tasks,
    last_boxed,
    math_equal,
    math_extract,
    math_reward,
)

__all__ = [
    "Task",
    "make_task",
    "per_item_reward",
    "check_rewards",
    "load_task",
    "load_spec_task",
    "load_jsonl_task",
    "reward_task",
    "resolve_tasks",
    "task_fingerprint",
    "TASK_SOURCES",
    "PYTHON_PREFIX",
    "known_tasks",
    "canonical_task_name",
    "make_copy_task",
    "make_countdown_task",
    "make_arithmetic_task",
    "load_humaneval",
    "GSM8K_PROMPT",
    "MATH_PROMPT",
    "COUNTDOWN_PROMPT",
    "gsm8k_reward",
    "gsm8k_extract",
    "math_reward",
    "math_extract",
    "math_equal",
    "last_boxed",
    "countdown_reward",
    "countdown_format_reward",
    "arithmetic_reward",
    "arithmetic_extract",
    "humaneval_reward",
    "mbpp_reward",
    "code_reward",
    "Check",
    "code_extract",
    "countdown_extract",
    "countdown_check",
    "countdown_evaluate",
    "countdown_answer",
    "copy_reward",
    "copy_extract",
]
