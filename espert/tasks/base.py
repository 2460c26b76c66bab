"""The :class:`Task` container and helpers to turn user callables into rewards.

A task is a list of prompts, the matching reference answers, a *batched* reward
``score(completions, answers) -> list[float]`` with values in ``[0, 1]`` and an
``extract(completion) -> str | None`` that returns the normalized final answer of a
completion (``None`` means the answer could not be extracted; it abstains in
majority voting and is left out of the answer-entropy distribution).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence


def chat_prompt(tokenizer, prompt: str) -> str:
    """``prompt`` as the text a chat model sees: one user turn in the tokenizer's chat template, with the
    assistant's turn opened (``add_generation_prompt``).  Every evaluator, sampler and ``espert compare``
    formats prompts this way when asked for the chat template."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )


BatchedReward = Callable[[Sequence[str], Sequence[str]], Sequence[float]]
PerItemReward = Callable[[str, str], float]
Extractor = Callable[..., Optional[str]]


def positional_arity(fn: Callable) -> int:
    """How many positional arguments ``fn`` takes (99 for ``*args``; -1 when unknown)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return -1
    kinds = [p.kind for p in sig.parameters.values()]
    if inspect.Parameter.VAR_POSITIONAL in kinds:
        return 99
    return sum(k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) for k in kinds)


def check_rewards(rewards: Sequence[float], n_expected: int, source: str = "reward") -> list[float]:
    """Validate a batch of rewards: right length, finite, inside ``[0, 1]``.

    Returns the rewards as a list of Python floats; raises ``ValueError`` otherwise.
    """
    try:
        out = [float(r) for r in rewards]
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source} returned non-numeric rewards: {e}") from None
    if len(out) != n_expected:
        raise ValueError(f"{source} returned {len(out)} rewards for {n_expected} completions")
    for i, r in enumerate(out):
        if math.isnan(r) or math.isinf(r):
            raise ValueError(f"{source} returned a non-finite reward ({r}) at position {i}")
        if r < 0.0 or r > 1.0:
            raise ValueError(f"{source} returned reward {r} at position {i}; rewards must lie in [0, 1]")
    return out


def per_item_reward(fn: PerItemReward) -> BatchedReward:
    """Wrap a per-item reward ``fn(completion, answer) -> float`` into a batched one."""

    def batched(completions: Sequence[str], answers: Sequence[str]) -> list[float]:
        return [float(fn(c, a)) for c, a in zip(completions, answers)]

    batched.__name__ = getattr(fn, "__name__", "per_item_reward")
    batched.__doc__ = getattr(fn, "__doc__", None)
    return batched


def _default_extract(completion: str) -> Optional[str]:
    """Default extractor for user tasks: the stripped completion, or ``None`` if empty."""
    s = completion.strip()
    return s or None


@dataclass
class Task:
    """A set of problems plus their reward and answer extractor.

    Attributes:
        name: task name (``"gsm8k"``, ``"math500"``, ``"countdown"``, ``"copy"`` or a user name).
        prompts: the prompts fed to the model.
        answers: reference answers, one per prompt (format is task specific, see docs/eval.md).
        reward_fn: batched reward ``fn(completions, answers) -> list[float]`` (values in [0, 1]).
        extract_fn: ``fn(completion) -> str | None`` or ``fn(completion, answer) -> str | None``.
        success_threshold: a sample counts as *correct* (for pass@k, maj@k, progressions)
            when its reward is ``>= success_threshold``. 1.0 for all built-in tasks.
        meta: free-form information (source, split, seed, ...).
    """

    name: str
    prompts: list[str]
    answers: list[str]
    reward_fn: BatchedReward
    extract_fn: Extractor = _default_extract
    success_threshold: float = 1.0
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.prompts = list(self.prompts)
        self.answers = list(self.answers)
        if len(self.prompts) != len(self.answers):
            raise ValueError(f"task {self.name!r}: {len(self.prompts)} prompts but {len(self.answers)} answers")
        if not (0.0 < self.success_threshold <= 1.0):
            raise ValueError(f"success_threshold must be in (0, 1], got {self.success_threshold}")
        self._extract_takes_answer = positional_arity(self.extract_fn) >= 2  # e.g. copy_extract(completion, answer)

    def __len__(self) -> int:
        return len(self.prompts)

    def score(self, completions: Sequence[str], answers: Sequence[str]) -> list[float]:
        """Batched reward: one float in ``[0, 1]`` per ``(completion, answer)`` pair.

        Raises ``ValueError`` if the lists differ in length or the reward function returns
        values that are not finite or not inside ``[0, 1]``.
        """
        completions = list(completions)
        answers = list(answers)
        if len(completions) != len(answers):
            raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
        if not completions:
            return []
        return check_rewards(self.reward_fn(completions, answers), len(completions), f"reward of task {self.name!r}")

    def score_with_status(self, completions: Sequence[str], answers: Sequence[str]) -> tuple[list[float], list | None]:
        """:meth:`score` and, for a code task, each check's status (``passed``, ``failed``, ``timeout``,
        ``output_limit``), from the same run of the checks; None for tasks whose reward has no status."""
        checked = getattr(self.reward_fn, "checked", None)
        if checked is None or not completions:
            return self.score(completions, answers), None
        return checked(list(completions), list(answers))

    def extract(self, completion: str, answer: Optional[str] = None) -> Optional[str]:
        """Normalized final answer of ``completion`` (``None`` = extraction failed / abstain).

        ``answer`` is only used by extractors that need it (the ``copy`` task takes the
        first ``len(answer)`` characters); other extractors ignore it.
        """
        if self._extract_takes_answer:
            return self.extract_fn(completion, answer)
        return self.extract_fn(completion)

    def is_correct(self, reward: float) -> bool:
        """Whether a sample with this reward counts as correct."""
        return reward >= self.success_threshold - 1e-12

    def subset(self, n: Optional[int]) -> "Task":
        """The first ``n`` problems (all if ``n`` is None)."""
        if n is None:
            return self
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        return replace(self, prompts=self.prompts[:n], answers=self.answers[:n], meta=dict(self.meta))


class PromptReward:
    """A reward ``fn(prompts, completions, answers) -> list[float]`` as a Task's batched reward.

    The task's answers are ``(prompt, answer)`` pairs: evaluators only pass answers along with
    the completions, so this is how every evaluator (torch, vLLM, a Ray pool) hands the reward
    the prompt of each completion without knowing about it.  Picklable when ``fn`` is.
    """

    def __init__(self, fn: Callable):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "reward")

    def __call__(self, completions: Sequence[str], pairs: Sequence[tuple[str, str]]) -> list[float]:
        return self.fn([p for p, _ in pairs], list(completions), [a for _, a in pairs])


def reward_fn_task(
    name: str, reward: Callable, prompts: Sequence[str], answers: Sequence[str], meta: Optional[dict] = None
) -> Task:
    """A :class:`Task` whose reward sees the prompts: ``reward(prompts, completions, answers)``."""
    prompts = list(prompts)
    return Task(
        name=name,
        prompts=prompts,
        answers=list(zip(prompts, answers)),
        reward_fn=PromptReward(reward),
        meta=dict(meta or {}),
    )


def make_task(
    name: str,
    prompts: Sequence[str],
    answers: Sequence[str],
    reward: Callable,
    extract: Optional[Extractor] = None,
    per_item: bool = False,
    success_threshold: float = 1.0,
    meta: Optional[dict] = None,
) -> Task:
    """Build a :class:`Task` from any user callable.

    Args:
        reward: batched ``fn(completions, answers) -> list[float]``, or, with
            ``per_item=True``, ``fn(completion, answer) -> float`` (wrapped to batched).
        extract: optional answer extractor (default: the stripped completion).
    """
    fn = per_item_reward(reward) if per_item else reward
    return Task(
        name=name,
        prompts=list(prompts),
        answers=list(answers),
        reward_fn=fn,
        extract_fn=extract or _default_extract,
        success_threshold=success_threshold,
        meta=dict(meta or {}),
    )
