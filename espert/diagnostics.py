"""ES diagnostics: pure functions of the logged members and rewards (estimator variance, antithetic statistics,
population diversity, forward FLOPs) and the training loop's :class:`IterationMeter` (docs/eval.md).

The exactness measurements (restore exactness, update fidelity) are in bench/exactness.py.
"""

from __future__ import annotations

import numpy as np

from espert.tasks.rewards import answer_classes

# Definitions (docs/eval.md, "ES diagnostics"), for one iteration with K antithetic pairs sharing a
# seed, rewards X⁺_k (sign +1) and X⁻_k (sign −1):
#   A_k = (X⁺_k − X⁻_k)/2   the antithetic coefficient (odd part: carries the gradient signal)
#   S_k = (X⁺_k + X⁻_k)/2   the even part (prompt difficulty, curvature: cancelled by antithetic pairs)
#   V₁  = (Var X⁺ + Var X⁻)/2 = Var A + Var S   the one-point coefficient variance per direction
#   ρ   = Corr(X⁺, X⁻)
#   κ   = Var A / V₁        antithetic vs one-point coefficient variance per direction; (1 − ρ)/2 when
#                           Var X⁺ = Var X⁻.  A linear reward has ρ = −1, κ = 1; an even one ρ = 1, κ = 0.
#   κ_eval = 2κ             the same ratio at an equal number of evaluations (a one-point estimator
#                           spends the 2K evaluations on 2K directions); antithetic pairs win iff κ_eval < 1
# Variances are population variances (ddof 0) over the K pairs.


def antithetic_stats(members, rewards) -> dict:
    """Estimator diagnostics of one iteration from its ``members`` [(seed, sign)] and ``rewards`` [N].

    Pairs are matched by seed; a pair with a non-finite reward is dropped.  Returns ``pairs`` (K),
    ``corr_pm`` (ρ), ``var_one`` (V₁), ``var_anti`` (Var A), ``var_even`` (Var S), ``kappa`` and
    ``kappa_eval``; statistics that are undefined (K < 2, or a zero variance) are ``None``.
    """
    plus: dict[int, float] = {}
    minus: dict[int, float] = {}
    for (seed, sign), r in zip(members, rewards):
        if r is not None and np.isfinite(r):
            (plus if sign > 0 else minus)[int(seed)] = float(r)
    seeds = [s for s in plus if s in minus]
    out = {
        "pairs": len(seeds),
        "corr_pm": None,
        "var_one": None,
        "var_anti": None,
        "var_even": None,
        "kappa": None,
        "kappa_eval": None,
    }
    if len(seeds) < 2:
        return out
    xp = np.array([plus[s] for s in seeds])
    xm = np.array([minus[s] for s in seeds])
    va, vs = float(np.var((xp - xm) / 2)), float(np.var((xp + xm) / 2))
    v1 = (float(np.var(xp)) + float(np.var(xm))) / 2
    out.update(var_one=v1, var_anti=va, var_even=vs)
    sp, sm = float(np.std(xp)), float(np.std(xm))
    if sp > 0 and sm > 0:
        out["corr_pm"] = float(np.clip(np.mean((xp - xp.mean()) * (xm - xm.mean())) / (sp * sm), -1.0, 1.0))
    if v1 > 0:
        out["kappa"] = va / v1
        out["kappa_eval"] = 2 * va / v1
    return out


def reward_spread(rewards) -> dict:
    """Population diversity in reward: ``std``, ``range`` (max − min) and ``n`` over the finite rewards."""
    v = np.array([float(r) for r in rewards if r is not None and np.isfinite(r)])
    if v.size == 0:
        return {"std": None, "range": None, "n": 0}
    return {"std": float(v.std()), "range": float(v.max() - v.min()), "n": int(v.size)}


def forward_flops(n_params: int, tokens: int) -> float:
    """Forward-pass FLOPs of processing ``tokens`` tokens with a ``n_params``-parameter model: 2·P·L.

    The usual dense approximation (one multiply-add per parameter per token); attention's
    context-length term is left out, which is exact to within a few percent for short contexts.
    """
    return 2.0 * float(n_params) * float(tokens)


def js_divergence(distributions) -> float:
    """Generalized Jensen-Shannon divergence (bits) of several discrete distributions, equal weights.

    ``distributions``: a list of ``{answer: count}`` mappings (counts, not necessarily normalized;
    empty ones are skipped).  JS = H(mean of the distributions) − mean of their entropies: 0 when
    all are identical, ``log2(M)`` for M point masses on distinct answers.
    """
    ps = []
    for d in distributions:
        tot = float(sum(d.values()))
        if tot > 0:
            ps.append({a: c / tot for a, c in d.items() if c > 0})
    if not ps:
        return 0.0

    def h(p) -> float:
        return -sum(v * np.log2(v) for v in p.values() if v > 0)

    mix: dict = {}
    for p in ps:
        for a, v in p.items():
            mix[a] = mix.get(a, 0.0) + v / len(ps)
    return max(0.0, float(h(mix) - sum(h(p) for p in ps) / len(ps)))


def population_js(member_answers, equivalent=None) -> dict:
    """Answer diversity of a population on shared prompts: generalized JS divergence (bits) per prompt, averaged.

    ``member_answers[m][p]``: member m's extracted answer (``str``; ``None``: nothing extracted or
    the member failed) on prompt p, one per member and prompt (greedy decoding).  Per prompt the
    answers are grouped into the task's equivalence classes (:func:`espert.tasks.rewards.answer_classes`
    with ``equivalent``, e.g. ``answer_equivalence(task.name)``); each answering member's distribution
    is a point mass on its class, so :func:`js_divergence` of them is the entropy of the class
    histogram, in ``[0, log2(answering members)]``.  Prompts with fewer than two answering members are
    left out.  Returns ``{"js": mean over the counted prompts (None: none counted), "prompts": how
    many were counted, "abstain": fraction of (member, prompt) answers that are None}``.
    """
    if not member_answers:
        return {"js": None, "prompts": 0, "abstain": None}
    n_prompts = len(member_answers[0])
    if any(len(m) != n_prompts for m in member_answers):
        raise ValueError("every member must answer the same prompts")
    vals, abstain = [], 0
    for p in range(n_prompts):
        labels = answer_classes([m[p] for m in member_answers], equivalent)
        answered = [{lab: 1} for lab in labels if lab is not None]
        abstain += len(labels) - len(answered)
        if len(answered) >= 2:
            vals.append(js_divergence(answered))
    total = n_prompts * len(member_answers)
    return {
        "js": float(np.mean(vals)) if vals else None,
        "prompts": len(vals),
        "abstain": abstain / total if total else None,
    }


def iteration_diagnostics(
    rec: dict,
    n_params: int | None = None,
    tokens: int | None = None,
    flops_before: float = 0.0,
    member_answers=None,
    equivalent=None,
) -> dict:
    """Per-iteration diagnostics of an ``iter`` log record: :func:`antithetic_stats` (antithetic runs),
    :func:`reward_spread`, when ``member_answers`` ([member][prompt], in the record's member order)
    are given their :func:`population_js` as ``answers`` (``equivalent``: the task's answer
    equivalence), and, when ``n_params`` and ``tokens`` (processed this iteration) are known,
    ``flops`` and the cumulative ``flops_total`` (``flops_before`` + this iteration)."""
    members, rewards = rec["members"], rec["rewards"]
    out = {"spread": reward_spread(rewards)}
    if any(sign < 0 for _, sign in members):
        out["antithetic"] = antithetic_stats(members, rewards)
    if member_answers is not None:
        if len(member_answers) != len(members):
            raise ValueError(f"member_answers has {len(member_answers)} members, the iteration {len(members)}")
        out["answers"] = population_js(member_answers, equivalent)
    if n_params is not None and tokens is not None:
        f = forward_flops(n_params, tokens)
        out.update(tokens=int(tokens), flops=f, flops_total=float(flops_before) + f)
    return out


def estimator_variance(
    evaluator, prompts, answers, sigma: float, pairs: int = 16, per_member: int = 16, seed: int = 0
) -> dict:
    """One-point vs antithetic coefficient variance, with common and with independent prompt sets.

    ``pairs`` seeds are drawn from ``seed``; each member (s, +1), (s, −1) is evaluated (``evaluator``:
    an :class:`espert.evaluators.Evaluator`) on ``per_member`` prompts:
    - ``common``: every member on the same prompt set (what the ES loop does);
    - ``independent``: every member on its own random prompt set from the pool.
    Returns ``{"common": antithetic_stats, "independent": antithetic_stats, "sigma", "pairs",
    "per_member"}``: the ratio of ``var_anti`` between the two shows how much prompt noise the
    shared prompts cancel.
    """
    import random

    pool = len(prompts)
    if pool < per_member or per_member < 1 or pairs < 2:
        raise ValueError(
            f"need pairs >= 2 and 1 <= per_member <= {pool} prompts, got pairs={pairs}, per_member={per_member}"
        )
    rng = random.Random(seed)
    seeds = [rng.getrandbits(63) for _ in range(pairs)]
    members = [(s, sign) for s in seeds for sign in (1, -1)]
    common = rng.sample(range(pool), per_member)
    rc = list(evaluator.evaluate(members, sigma, [prompts[i] for i in common], [answers[i] for i in common]))
    ri = []
    for m in members:
        idx = rng.sample(range(pool), per_member)
        ri.extend(evaluator.evaluate([m], sigma, [prompts[i] for i in idx], [answers[i] for i in idx]))
    return {
        "sigma": sigma,
        "pairs": pairs,
        "per_member": per_member,
        "common": antithetic_stats(members, rc),
        "independent": antithetic_stats(members, ri),
    }


class IterationMeter:
    """Per-iteration diagnostics for the training loop, with cumulative forward FLOPs and answer diversity.

    FLOPs need the evaluator's processed-token counter (``tokens_processed``: prompt plus generated
    tokens of every rollout so far, kept by the torch evaluator) and the model's parameter count;
    evaluators without them log no FLOPs.  Answer diversity needs the evaluator's ``member_answers``
    (the extracted answers of its last ``evaluate``; evaluators built with the task's ``extract``),
    grouped by ``equivalent`` (the task's answer equivalence; None: identical strings).
    ``records``: the run's earlier ``iter`` records, so a resumed run continues the cumulative sum.
    """

    def __init__(self, evaluator, records=(), equivalent=None):
        model = getattr(evaluator, "model", None)
        self.evaluator = evaluator
        self.equivalent = equivalent
        self.n_params = sum(p.numel() for p in model.parameters()) if model is not None else None
        self.tokens_seen = None
        last = [r.get("diagnostics") or {} for r in records]
        self.flops_total = float(last[-1].get("flops_total") or 0.0) if last else 0.0

    def start(self) -> None:
        """Mark the start of an iteration's rollouts (held-out evaluations in between do not count)."""
        self.tokens_seen = getattr(self.evaluator, "tokens_processed", None)

    def __call__(self, rec: dict) -> dict:
        """:func:`iteration_diagnostics` of ``rec`` with the tokens processed since :meth:`start` and the
        evaluator's ``member_answers`` (those of the iteration's ``evaluate``)."""
        now = getattr(self.evaluator, "tokens_processed", None)
        tokens = None if now is None or self.tokens_seen is None else now - self.tokens_seen
        answers = getattr(self.evaluator, "member_answers", None)
        out = iteration_diagnostics(rec, self.n_params, tokens, self.flops_total, answers, self.equivalent)
        self.flops_total = out.get("flops_total", self.flops_total)
        return out
