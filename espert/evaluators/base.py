"""The Evaluator interface: the only thing the ES loop knows about a model backend.

The loop hands an evaluator a population of members ``(seed, sign)`` and the prompts of the
iteration, and gets one reward per member back.  It then hands back the update as seeds and
coefficients.  It never sees weights, devices or generation code, so a torch model, one vLLM
engine or many engines behind Ray all look the same to it.

Contract of an :class:`Evaluator` (what the loop relies on):

``evaluate(members, sigma, prompts, answers) -> list[float]``
    One reward per member, in member order: the mean task reward over the prompts of the
    model with weights ``center + sign·σ·ε(seed)``.  ``nan`` marks a member that failed (the
    loop drops it from the update).  The weights are back at the exact center when it
    returns *or raises*.  Must be a deterministic function of (center, members, σ, prompts):
    resumed runs rely on it to reproduce rewards.
``evaluate_center(prompts, answers) -> list[float]``
    Per-prompt rewards of the center itself (held-out evaluation).
``update(seeds, coeffs, decay=1.0)``
    ``center <- decay·center + Σ_n coeffs[n]·ε(seeds[n])`` on the float32 master, then the live
    weights are restored to the new center.  Every replica must apply the same arithmetic: the
    update goes through the CPU op on the host master, so it is bit-identical everywhere.
``center_state() -> dict[str, Tensor]`` / ``load_center(state)``
    The float32 master by logical (checkpoint) name; what checkpoints save and replay rebuilds.
``center_stream() -> chunk source | None``
    Optional: the center as a chunk source (:mod:`espert.tensorfile`) for backends whose center
    lives elsewhere (vLLM's workers); checkpoints and exports are then written chunk by chunk and
    the driver never holds the whole center.  Default None: checkpoints use ``center_state()`` and
    ``export_state()``.
``noise_energy() -> float | None``
    Σ_t n_t·s_t² over the moved tensors (n_t elements, σ scale s_t), for the ``step_norm`` metric
    (:func:`espert.es.step_norm`); None when unknown.  Default: every tensor of the center
    (:func:`center_energy`) at scale 1; a :class:`ModelEvaluator` asks its center.
``close()``
    Free the model.
``member_answers`` (optional)
    After ``evaluate``: ``member_answers[m][p]``, the task's extracted answer (``str``, or ``None``
    when nothing was extracted or member m failed) of member m on prompt p; ``None`` when the
    evaluator extracts no answers (built without the task's ``extract``, or it cannot).  The loop's
    answer-diversity diagnostic reads it; an evaluator without it simply logs none.

:class:`ModelEvaluator` implements all of it for backends that hold one :class:`~espert.center.Center`
and can score the current live weights (``rollout``); a backend only writes ``rollout``.
"""

from __future__ import annotations

import abc
import logging
import math
import time
from collections import defaultdict
from typing import Callable, Mapping, Sequence

import torch

from espert.center import OPTIM_PREFIX, Center

log = logging.getLogger("espert.evaluators")

Member = tuple[int, int]  # (seed: uint64, sign: +1 | -1)


class Evaluator(abc.ABC):
    """Abstract evaluator: see the module docstring for the contract."""

    #: [member][prompt] extracted answers of the last ``evaluate`` (None: not extracted; see the module doc).
    member_answers: list[list[str | None]] | None = None

    @abc.abstractmethod
    def evaluate(
        self, members: Sequence[Member], sigma: float, prompts: Sequence[str], answers: Sequence[str]
    ) -> list[float]:
        """Mean reward over ``prompts`` of each perturbed member; ``nan`` = failed member."""

    @abc.abstractmethod
    def evaluate_center(self, prompts: Sequence[str], answers: Sequence[str]) -> list[float]:
        """Per-prompt rewards of the (unperturbed) center."""

    @abc.abstractmethod
    def update(
        self, seeds: Sequence[int], coeffs: Sequence[float], decay: float = 1.0, lr: float | None = None
    ) -> None:
        """``center <- decay·center``, then the step ``Σ coeffs[n]·ε(seeds[n])`` (through the center's
        optimizer; ``lr`` is the iteration's α), then restore the live weights."""

    @abc.abstractmethod
    def center_state(self) -> dict[str, torch.Tensor]:
        """The exact center (float32 master) by logical parameter name, on the host."""

    @abc.abstractmethod
    def load_center(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace the center exactly (names, shapes and dtypes must match) and restore the weights.  A
        resume passes a lazily read checkpoint (``runs.CenterFile``: each tensor read when asked for)."""

    def export_state(self) -> dict[str, torch.Tensor]:
        """The center as checkpoint values by logical name (what exports write); default: center_state()."""
        return self.center_state()

    def center_stream(self):
        """The center as a chunk source (``layout``, ``chunk_bytes``, iteration of ``(name, offset, flat
        tensor)``; see :mod:`espert.tensorfile`) with the names and bytes of :meth:`center_state`, or None
        (the default) when the backend has it in memory anyway: checkpoints then use the dicts."""
        return None

    def noise_energy(self) -> float | None:
        """Σ_t n_t·s_t² over the moved tensors (see the module docstring); None when unknown."""
        return center_energy(self)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the model."""


def center_energy(evaluator: Evaluator, scales: Mapping[str, float] | None = None) -> float | None:
    """Σ_t n_t·s_t² over the center's tensors (optimizer state excluded): sizes from the evaluator's chunk
    source when it streams (its layout only: nothing is pulled), else from ``export_state()``; s_t from
    ``scales`` (logical name -> σ multiplier, default 1).  None when the center cannot be read."""
    scales = scales or {}
    try:
        stream = evaluator.center_stream()
        if stream is not None:
            sizes = {n: math.prod(s) for n, (s, _) in stream.layout.items() if not n.startswith(OPTIM_PREFIX)}
        else:
            sizes = {n: t.numel() for n, t in evaluator.export_state().items()}
        return float(sum(k * scales.get(n, 1.0) ** 2 for n, k in sizes.items()))
    except Exception:  # noqa: BLE001 - a metric only; the run does not depend on it
        return None


def score_members(
    members: Sequence[Member],
    sigma: float,
    prompts: Sequence[str],
    answers: Sequence[str],
    perturb,
    restore,
    rollout,
    member_errors: str = "raise",
    timings: dict[str, float] | None = None,
    answers_out: list | None = None,
) -> list[float]:
    """The member loop every evaluator shares: perturb → rollout → restore (in ``finally``) per member.

    perturb(seed, sigma, sign), restore(), rollout(prompts, answers) -> per-prompt rewards.
    Returns each member's mean reward; with member_errors="nan" a failing member scores ``nan``
    (logged), with "raise" the exception propagates after the weights are restored.  timings, if
    given, accumulates seconds under "perturb", "generate", "restore" and counts "members".
    answers_out: when a list, rollout returns ``(rewards, extracted answers)`` instead and each
    member's extracted answers (one per prompt; all ``None`` for a failed member) are appended to it.
    """
    if len(prompts) != len(answers) or not prompts:
        raise ValueError(f"need the same, nonzero number of prompts and answers; got {len(prompts)} and {len(answers)}")
    t = timings if timings is not None else defaultdict(float)
    out = []
    for seed, sign in members:
        t0 = time.perf_counter()
        try:
            perturb(seed, sigma, sign)
            t1 = time.perf_counter()
            t["perturb"] += t1 - t0
            rewards = rollout(prompts, answers)
            if answers_out is not None:
                rewards, extracted = rewards
            t["generate"] += time.perf_counter() - t1
        except Exception as e:  # noqa: BLE001 - rule chosen by member_errors
            if member_errors == "raise":
                raise
            log.warning("member (seed=%d, sign=%+d) failed, dropped: %r", seed, sign, e)
            rewards, extracted = [math.nan], [None] * len(prompts)
        finally:
            t2 = time.perf_counter()
            restore()
            t["restore"] += time.perf_counter() - t2
        t["members"] += 1
        if answers_out is not None:
            answers_out.append(list(extracted))
        out.append(math.fsum(rewards) / len(rewards) if rewards else math.nan)
    return out


def score_and_extract(
    score: Callable, extract: Callable, completions: Sequence[str], answers: Sequence
) -> tuple[list[float], list[str | None]]:
    """``(rewards, extracted)`` of ``completions``: the task's batched ``score(completions, answers)`` and
    ``extract(completion, answer)`` (:meth:`espert.tasks.Task.extract`) of each completion."""
    return list(score(completions, answers)), [extract(c, a) for c, a in zip(completions, answers)]


class ModelEvaluator(Evaluator):
    """An evaluator over one :class:`~espert.center.Center`: perturb, ``rollout``, restore in ``finally``.

    Subclasses implement :meth:`rollout` (per-prompt rewards of the live weights as they are now).
    member_errors: ``"raise"`` (default: an exception in a member's rollout propagates, after the
    weights are restored) or ``"nan"`` (the member gets reward ``nan``, is logged, and the loop
    drops it from the update).  A subclass that sets :attr:`extract` also implements
    ``rollout_answers(prompts, answers) -> (rewards, extracted answers)``, and :meth:`evaluate` then
    fills :attr:`member_answers`.
    """

    #: The task's answer extractor ``fn(completion, answer) -> str | None`` (a Task's ``extract``), or None.
    extract: Callable | None = None
    #: Mean token entropy (bits) of the center's next-token distribution over the tokens generated by
    #: the last :meth:`evaluate_center`, where the evaluator can compute it (torch), else None.
    last_token_entropy: float | None = None

    def __init__(self, center: Center, member_errors: str = "raise"):
        if member_errors not in ("raise", "nan"):
            raise ValueError(f"member_errors must be 'raise' or 'nan', got {member_errors!r}")
        self.center = center
        self.member_errors = member_errors

    @abc.abstractmethod
    def rollout(self, prompts: Sequence[str], answers: Sequence[str]) -> list[float]:
        """Per-prompt rewards in [0, 1] (``nan`` allowed) of the live weights, which it must not change."""

    def evaluate(self, members, sigma, prompts, answers):
        ext = None if self.extract is None else []
        rollout = self.rollout if ext is None else self.rollout_answers
        rewards = score_members(
            members,
            sigma,
            prompts,
            answers,
            self.center.perturb,
            self.center.restore,
            rollout,
            self.member_errors,
            answers_out=ext,
        )
        self.member_answers = ext
        return rewards

    def evaluate_center(self, prompts, answers):
        return list(self.rollout(prompts, answers))

    def update(self, seeds, coeffs, decay=1.0, lr=None):
        self.center.update(seeds, coeffs, decay, lr)

    def center_state(self):
        return self.center.state_dict()

    def export_state(self):
        return self.center.export_state()

    def noise_energy(self):
        return self.center.noise_energy()

    def load_center(self, state):
        # a lazy checkpoint (runs.CenterFile) is read whole here: the model is in this process anyway
        self.center.load_state_dict(dict(state) if isinstance(state, Mapping) else state)
