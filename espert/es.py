"""The ES algorithm: derived seeds, reward normalization, coefficients and a step that fits on a screen.

Pure: no run directory, no model, no torch.  The run (orchestration, resume, tracking) is
:mod:`espert.trainer`; the config is :mod:`espert.config`.

The step (``es_step``), with N members, antithetic pairs sharing a seed::

    σ_t, α_t   = schedules at iteration t
    members    = [(s_k, +1), (s_k, -1) for k < N/2]        s_k = member_seed(seed, t, k)
    r_n        = evaluator.evaluate(members, σ_t, prompts_t)  mean task reward of θ + sign_n·σ_t·ε(s_n)
    z_n        = normalize(r) · min(1, std(r)/floor)          over valid members (nan = failed, dropped)
    c_k        = α_t / N_valid · Σ_{n: seed s_k} sign_n·z_n   one coefficient per seed
    θ         <- (1 - α_t·wd)·θ + Σ_k c_k·ε(s_k)              fused, on the float32 master
    θ         <- θ_0 + (1 - α_t·λ)·(θ - θ_0)                   anchored weight decay (AWD), when λ > 0
                 (l1: θ - θ_0 soft-thresholded by α_t·λ)       θ_0: the base weights

so θ ← θ + α·(1/N)·Σ z_n ε_n exactly as in ES-at-Scale (Qiu et al. 2025): **we do not divide by
σ** (the gradient estimate is (1/(Nσ))·Σ z_n ε_n, so α here plays the role of lr·σ; the seed
papers use α = σ/2).  Noise never exists as a tensor: perturbation and update regenerate
ε(seed, key, index) inside the kernels.  Everything that moves θ is logged before it is applied
(seeds, coefficients, decay, anchor step), so a run is replayable from the base model and its log alone.

Failure rule: a member whose reward is nan or infinite (failed rollout) is dropped; z-scores/ranks are
computed over the valid members and N_valid divides the sum.  All valid rewards equal → zero
update (no nan), and the record says ``zero_spread``.  No valid member → the update (and the decay) is
skipped and the record says so (``skipped``).

Derived randomness (all pure functions of ``ESConfig.seed``, documented for other implementations)::

    derive_seed(tag, master, t, j) = uint64 little-endian of sha256(f"espert/{tag}/{master}/{t}/{j}")[:8]
    member_seed(master, t, k)      = derive_seed("member", master, t, k)
    prompt_indices(t), sha256      = the first P of a Fisher–Yates shuffle of range(pool) whose j-th swap
                                     partner is j + derive_seed("prompts", master, t, j + 1) mod (pool - j)
    prompt_indices(t), python_random = random.Random(derive_seed("prompts", master, t, 0)).sample(range(pool), P)

``python_random`` (runs written before the ``prompt_sampler`` field) depends on CPython's
``random`` module; ``sha256`` depends on nothing but this definition.  Either way the indices
are logged with each iteration, and a resume checks the log against them.

Noise floor: with rewards equal up to rounding, z-scores and ranks blow float ulps up to a
full-size step.  When the population std of the valid rewards is below ``reward_std_floor``
(default 1e-6, in reward units) every z_n is multiplied by std/floor, so the step shrinks in
proportion and vanishes with the spread.

Step sizes of the normalizations: z-scores have unit std; ``rank`` (centered ranks in
[-0.5, 0.5], as in OpenAI-ES and ES-at-Scale) has std ≈ 1/√12 ≈ 0.29, so at equal α its step is
≈3.5× smaller; ``rank_unit`` scales the centered ranks to unit std, giving the zscore step size
with rank robustness.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from espert.config import NORMALIZATIONS, SCHEDULES, U64, ESConfig
from espert.update import Update

if TYPE_CHECKING:  # pragma: no cover - the evaluator layer is below; only its types are named here
    from espert.evaluators.base import Evaluator, Member


# ---- derived randomness ------------------------------------------------------------------------


def derive_seed(tag: str, master: int, t: int, j: int) -> int:
    """uint64 from sha256(f"espert/{tag}/{master}/{t}/{j}"): first 8 bytes, little-endian."""
    return int.from_bytes(hashlib.sha256(f"espert/{tag}/{master}/{t}/{j}".encode()).digest()[:8], "little")


def member_seed(master: int, t: int, k: int) -> int:
    """Seed of member (or antithetic pair) k at iteration t."""
    return derive_seed("member", master, t, k)


def population(cfg: ESConfig, t: int) -> list[Member]:
    """The members ``(seed, sign)`` of iteration t: antithetic pairs ``(s_k, +1), (s_k, -1)``, or N seeds with +1."""
    if cfg.antithetic:
        return [(member_seed(cfg.seed, t, k), sign) for k in range(cfg.population // 2) for sign in (1, -1)]
    return [(member_seed(cfg.seed, t, k), 1) for k in range(cfg.population)]


def prompt_indices(cfg: ESConfig, t: int, pool: int) -> list[int]:
    """Indices into the training pool for iteration t (all of it, in order, when it is small enough).

    ``cfg.prompt_sampler`` picks the derivation (module docstring); both are pure functions of
    (seed, t, pool, prompts_per_iteration).
    """
    p = cfg.prompts_per_iteration
    if p >= pool:
        return list(range(pool))
    if cfg.prompt_sampler == "python_random":  # version-1 runs (espert.runs.legacy, rule 1a)
        return random.Random(derive_seed("prompts", cfg.seed, t, 0)).sample(range(pool), p)
    moved: dict[int, int] = {}  # sparse Fisher–Yates: only the swapped slots are stored
    out = []
    for j in range(p):
        r = j + derive_seed("prompts", cfg.seed, t, j + 1) % (pool - j)
        out.append(moved.get(r, r))
        moved[r] = moved.get(j, j)
    return out


def schedule(kind: str, start: float, end: float | None, t: int, total: int) -> float:
    """Value at iteration t in [1, total]: constant, linear or cosine from ``start`` (t=1) to ``end`` (t=total)."""
    if kind == "constant" or end is None:
        return start
    p = (t - 1) / (total - 1) if total > 1 else 0.0
    if kind == "linear":
        return start + (end - start) * p
    if kind == "cosine":
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"unknown schedule {kind!r}; use one of {SCHEDULES}")


# ---- normalization and coefficients -------------------------------------------------------------


def normalize(rewards: Sequence[float], method: str = "zscore", floor: float = 0.0) -> np.ndarray:
    """Rewards [N] (nan = failed member) -> normalized scores z [N] float64, 0 for failed members.

    zscore: (r - mean) / std over the valid members (population std); rank: centered ranks
    rank/(n-1) - 0.5 in [-0.5, 0.5], ties sharing their average rank; rank_unit: those ranks
    divided by their std.  All valid rewards equal (or fewer than two valid members) → all zeros.
    floor: the noise floor; when std(valid rewards) < floor, z is multiplied by std/floor.
    """
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    valid = np.isfinite(r)
    z = np.zeros_like(r)
    v = r[valid]
    if v.size < 2 or v.max() == v.min():
        return z
    if method == "zscore":
        d = v - v.mean()
        d = d / np.abs(d).max()  # scale first: tiny reward gaps must not underflow the std
        z[valid] = d / d.std()
    elif method == "rank":
        less = (v[None, :] < v[:, None]).sum(1)
        equal = (v[None, :] == v[:, None]).sum(1)
        z[valid] = (less + (equal - 1) / 2.0) / (v.size - 1) - 0.5
    elif method == "rank_unit":
        less = (v[None, :] < v[:, None]).sum(1)
        equal = (v[None, :] == v[:, None]).sum(1)
        c = less + (equal - 1) / 2.0 - (v.size - 1) / 2.0  # centered ranks, exact in float64
        z[valid] = c / c.std()
    else:
        raise ValueError(f"unknown normalization {method!r}; use one of {NORMALIZATIONS}")
    if floor > 0:
        std = float(v.std())
        if std < floor:
            z *= std / floor
    return z


def coefficients(
    members: Sequence[Member], rewards: Sequence[float], z: np.ndarray, alpha: float
) -> tuple[list[int], list[float]]:
    """Per-seed update coefficients c_k = α/N_valid · Σ sign_n·z_n (valid members only, zeros dropped).

    Seeds appear in first-member order, so the fused update sums members in a fixed order.
    """
    valid = [math.isfinite(r) for r in rewards]
    n_valid = sum(valid)
    acc: dict[int, float] = {}
    for (seed, sign), zi, ok in zip(members, z, valid):
        if ok:
            acc[seed] = acc.get(seed, 0.0) + sign * float(zi)
    pairs = [(s, alpha * v / n_valid) for s, v in acc.items()]
    pairs = [(s, c) for s, c in pairs if c != 0.0]
    return [s for s, _ in pairs], [c for _, c in pairs]


def step_norm(coeffs: Sequence[float], noise_energy: float) -> float:
    """‖Σ_k c_k ε_k‖ expected for independent unit-variance noise: √(noise_energy · Σ c_k²).

    noise_energy = Σ_t n_t·s_t² over the moved tensors (n_t elements, σ scale s_t; the parameter
    count when every s_t = 1).  Over millions of elements the realized norm is within a fraction
    of a percent of this, and it costs nothing to compute.
    """
    return math.sqrt(noise_energy * math.fsum(c * c for c in coeffs))


def reward_stats(rewards: Sequence[float]) -> dict:
    """mean/max/min/std over the valid (finite) rewards, and how many were valid."""
    v = np.asarray([r for r in rewards if math.isfinite(r)], dtype=np.float64)
    if v.size == 0:
        return {"mean": None, "max": None, "min": None, "std": None, "n_valid": 0}
    return {
        "mean": float(v.mean()),
        "max": float(v.max()),
        "min": float(v.min()),
        "std": float(v.std()),
        "n_valid": int(v.size),
    }


# ---- the step ---------------------------------------------------------------------------------


def es_step(
    evaluator: Evaluator,
    cfg: ESConfig,
    t: int,
    prompts: Sequence[str],
    answers: Sequence[str],
    write_ahead: Callable[[dict], None] | None = None,
    noise_energy: float | None = None,
) -> dict:
    """One ES iteration t (1-based): evaluate the population, normalize, log, update the center.

    ``write_ahead(record)`` is called after the update is decided and before it is applied (the run
    log); the record holds everything that moves θ: ``seeds``, ``coeffs`` (float64, rounded to
    float32 by the op), ``decay`` and ``anchor`` (the AWD step ``{"norm", "amount": α·λ}``, or None).  noise_energy (see :func:`step_norm`): when given, the
    record's ``step_norm`` is ‖Σ c_k ε_k‖.  Returns the record.
    """
    t0 = time.time()
    sigma = schedule(cfg.sigma_schedule, cfg.sigma, cfg.sigma_end, t, cfg.iterations)
    alpha = schedule(cfg.alpha_schedule, cfg.alpha, cfg.alpha_end, t, cfg.iterations)
    members = population(cfg, t)
    rewards = [float(r) for r in evaluator.evaluate(members, sigma, prompts, answers)]
    if len(rewards) != len(members):
        raise RuntimeError(f"evaluator returned {len(rewards)} rewards for {len(members)} members")
    z = normalize(rewards, cfg.normalization, cfg.reward_std_floor)
    seeds, coeffs = coefficients(members, rewards, z, alpha)
    stats = reward_stats(rewards)
    skipped = stats["n_valid"] == 0
    decay = 1.0 if skipped else 1.0 - alpha * cfg.weight_decay
    anchor = (
        None if skipped or not cfg.anchor_decay else {"norm": cfg.anchor_decay_norm, "amount": alpha * cfg.anchor_decay}
    )
    record = {
        "kind": "iter",
        "iteration": t,
        "sigma": sigma,
        "alpha": alpha,
        "members": [list(m) for m in members],
        "rewards": [r if math.isfinite(r) else None for r in rewards],
        "reward": stats,
        "seeds": seeds,
        "coeffs": coeffs,
        "decay": decay,
        "anchor": anchor,
        "skipped": skipped,
        "zero_spread": not skipped and stats["max"] == stats["min"],
        "step_norm": None if noise_energy is None else step_norm(coeffs, noise_energy),
        "eval_seconds": round(time.time() - t0, 4),
    }
    if write_ahead is not None:
        write_ahead(record)
    apply_record(evaluator, record)
    return record


def apply_record(evaluator: Evaluator, record: dict) -> None:
    """Apply a logged update (training and replay share this): decay, then Σ coeffs·ε(seeds) through the
    optimizer, whose step size is the record's α, then the anchor step when the record has one (records
    written before AWD have none).  ``evaluator``: anything with ``update(step: Update)`` (an Evaluator or a
    Center)."""
    step = Update.of_record(record)
    if step is not None:
        evaluator.update(step)


__all__ = [
    "ESConfig",
    "NORMALIZATIONS",
    "SCHEDULES",
    "U64",
    "es_step",
    "apply_record",
    "normalize",
    "coefficients",
    "population",
    "prompt_indices",
    "member_seed",
    "derive_seed",
    "schedule",
    "reward_stats",
    "step_norm",
]
