"""RandOpt ("Neural Thickets", arXiv 2603.12228; code sunrainyg/RandOpt) on espert's evaluators.

N random perturbations of the base, each over a grid of σ, are scored once on the training prompts;
the best K are kept, and at inference the K perturbed models answer and a majority vote decides::

    member k < N:  s_k = member_seed(seed, 0, k)          σ_k = grid[derive_seed("randopt-sigma", seed, 0, k) mod |grid|]
    r_k            = mean task reward of θ0 + σ_k·ε(s_k) on the prompts of prompt_indices(cfg, 1, pool)
    ensemble       = the K members of highest r_k (ties: smaller k first), each kept as (s_k, σ_k)
    answer         = plurality vote of the K members' greedy answers (``espert eval RUN``: maj@K)

(ES iterations start at t = 1, so t = 0 gives RandOpt seeds of its own.)  In espert a perturbed model
*is* its seed: an ensemble of K models is K pairs (seed, σ) in ``RUN/ensemble.json``, not K copies.

Pure like :mod:`espert.es` (no torch, no files): the run-directory driver is
:func:`espert.trainer.train_randopt`, replay's check :func:`check_log`.  Every member's record
``{"kind": "member", "k", "seed", "sigma", "reward"}`` is logged before the next window of members is
evaluated, so a killed run resumes where its log ends and the ensemble is a function of the log.
Distillation of the ensemble into one model (the paper's optional SFT step) is not implemented.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

from espert.config import ESConfig, sigma_grid
from espert.es import derive_seed, member_seed

if TYPE_CHECKING:  # pragma: no cover - the evaluator layer is below; only its type is named here
    from espert.evaluators.base import Evaluator

#: Members evaluated between two writes of the log (a kill loses at most this many evaluations).
WINDOW = 32
#: The file of a RandOpt run (and of espert compare's RandOpt arm) that ``espert eval`` reads.
ENSEMBLE = "ensemble.json"


def member(cfg: ESConfig, k: int) -> tuple[int, float]:
    """(seed, σ) of member k: a pure function of (cfg.seed, k, cfg.randopt_sigmas)."""
    grid = sigma_grid(cfg.randopt_sigmas)
    return member_seed(cfg.seed, 0, k), grid[derive_seed("randopt-sigma", cfg.seed, 0, k) % len(grid)]


def score_members(
    evaluator: Evaluator, cfg: ESConfig, ks: Sequence[int], prompts: Sequence[str], answers: Sequence[str]
) -> list[dict]:
    """The records of members ``ks`` (in that order): each perturbed once by +σ_k·ε(s_k) and scored on
    ``prompts``.  Members that share a σ go to the evaluator together (one call per σ: batched LoRA members
    share a generate).  A failed member scores None (its reward was nan)."""
    pairs = {k: member(cfg, k) for k in ks}
    reward: dict[int, float] = {}
    for sigma in dict.fromkeys(s for _, s in pairs.values()):
        group = [k for k in ks if pairs[k][1] == sigma]
        got = evaluator.evaluate([(pairs[k][0], 1) for k in group], sigma, prompts, answers)
        reward.update(zip(group, got))
    return [
        {
            "kind": "member",
            "k": k,
            "seed": pairs[k][0],
            "sigma": pairs[k][1],
            "reward": reward[k] if math.isfinite(reward[k]) else None,
        }
        for k in ks
    ]


def select_top(records: Sequence[dict], top_k: int) -> list[dict]:
    """The ``top_k`` member records of highest reward (None, a failed member, ranks last; ties: smaller k)."""
    ranked = sorted(records, key=lambda r: (r["reward"] is None, -(r["reward"] or 0.0), r["k"]))
    return [
        {"rank": i + 1, **{f: r[f] for f in ("k", "seed", "sigma", "reward")}} for i, r in enumerate(ranked[:top_k])
    ]


def ensemble_doc(cfg: ESConfig, base_model: str, records: Sequence[dict], prompts: int) -> dict:
    """The content of ``ensemble.json``: the members (rank, k, seed, σ, training reward), what made them (the
    run's config, whose noise, σ mode and parameter selection rebuild each member exactly) and the base."""
    grid = sigma_grid(cfg.randopt_sigmas)
    by_sigma = {s: [r["reward"] for r in records if r["sigma"] == s and r["reward"] is not None] for s in grid}
    return {
        "method": "randopt",
        "base_model": base_model,
        "population": len(records),
        "prompts": prompts,
        "top_k": cfg.randopt_top_k,
        "members": select_top(records, cfg.randopt_top_k),
        "sigma_mean_reward": {str(s): (sum(v) / len(v) if v else None) for s, v in by_sigma.items()},
        "config": cfg.to_dict(),
    }


def check_log(cfg: ESConfig, records: Sequence[dict]) -> dict:
    """Replay of a RandOpt run: every logged member's (seed, σ) must be the one ``cfg`` derives, and the logged
    ensemble the top K of the logged rewards.  Returns ``{"members", "ensemble": [(seed, σ)] or None}``;
    raises ValueError naming the first record that differs."""
    members = [r for r in records if r.get("kind") == "member"]
    for r in members:
        if (r["seed"], r["sigma"]) != member(cfg, r["k"]):
            raise ValueError(
                f"member {r['k']}: logged (seed, sigma) {(r['seed'], r['sigma'])} is not what the config derives"
            )
    logged = next((r for r in reversed(records) if r.get("kind") == "ensemble"), None)
    if logged is None:
        return {"members": len(members), "ensemble": None}
    want = [(r["seed"], r["sigma"]) for r in select_top(members, cfg.randopt_top_k)]
    got = [(m["seed"], m["sigma"]) for m in logged["members"]]
    if got != want:
        raise ValueError(f"the logged ensemble {got[:3]}... is not the top {cfg.randopt_top_k} of the logged rewards")
    return {"members": len(members), "ensemble": got}


__all__ = ["ENSEMBLE", "WINDOW", "member", "score_members", "select_top", "ensemble_doc", "check_log"]
