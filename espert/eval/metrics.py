"""Evaluation metrics: pass@k, maj@k, accuracy histogram, answer entropy, progressions.

All definitions are documented in ``docs/eval.md`` and are exactly what is implemented
here. Inputs are per-problem lists of per-sample correctness flags and extracted answers.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Hashable, Iterable, Optional, Sequence

import numpy as np

#: Labels of the 12 accuracy-histogram bins (per-problem fraction of correct samples).
ACC_BIN_LABELS = ["0", *(f"({i / 10:g},{(i + 1) / 10:g}]" for i in range(9)), "(0.9,1)", "1"]

SOLVE_RULES = ("any", "majority", "vote")


def _check_int(name: str, v: int) -> int:
    if isinstance(v, bool) or int(v) != v:
        raise ValueError(f"{name} must be an integer, got {v!r}")
    return int(v)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimate ``1 - C(n-c, k) / C(n, k)`` for one problem.

    ``n`` samples were drawn, ``c`` of them are correct. Computed with the stable product
    ``1 - prod_{i=n-c+1}^{n} (1 - k / i)`` (Chen et al., 2021). Raises ``ValueError``
    unless ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    n, c, k = _check_int("n", n), _check_int("c", c), _check_int("k", k)
    if n < 1:
        raise ValueError(f"pass@k needs at least one sample (n={n})")
    if not 0 <= c <= n:
        raise ValueError(f"number of correct samples c={c} must be in [0, n={n}]")
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be in [1, n={n}]")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def k_values(n: int) -> list[int]:
    """The k reported for ``n`` samples: 1, 2, 4, ... (powers of two <= n) plus n itself."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    ks = [2**i for i in range(n.bit_length())]  # the powers of two <= n
    return ks if ks[-1] == n else ks + [n]


MAJ_METHODS = ("subsets", "first")


def maj_at_k(
    extracted: Sequence[Optional[Hashable]], correct: Sequence[bool], k: int, method: str = "subsets"
) -> float:
    """Majority-vote score of one problem at k votes (docs/eval.md, section 4).

    ``extracted``: per-sample answers (strings or :func:`answer_classes` labels; ``None`` abstains);
    ``correct``: per-sample flags.  ``method="subsets"`` (default): the exact mean of the vote over all
    ``C(n, k)`` k-subsets (:func:`maj_at_k_subsets`); ``"first"``: the vote of the first k samples (it depends
    on the sample order).  An answer is correct iff all its voting samples are.  The plurality answer wins; a
    tie scores the fraction of the tied answers that are correct; if every vote abstains the score is 0.
    """
    k = _check_int("k", k)
    if len(extracted) != len(correct):
        raise ValueError(f"{len(extracted)} extracted answers but {len(correct)} correctness flags")
    if not 1 <= k <= len(extracted):
        raise ValueError(f"k={k} must be in [1, n={len(extracted)}]")
    if method == "subsets":
        return maj_at_k_subsets(extracted, correct, k)
    if method != "first":
        raise ValueError(f"unknown maj@k method {method!r}; use one of {', '.join(MAJ_METHODS)}")
    return _vote(extracted[:k], correct[:k])


def _vote(extracted: Sequence[Optional[Hashable]], correct: Sequence[bool]) -> float:
    """Plurality vote of one set of samples, ties scored as the fraction of tied answers that are correct."""
    votes, ans_correct = _tally(extracted, correct)
    if not votes:
        return 0.0
    top = max(votes.values())
    tied = [a for a, v in votes.items() if v == top]
    return sum(1 for a in tied if ans_correct[a]) / len(tied)


def _tally(extracted: Sequence[Optional[Hashable]], correct: Sequence[bool]) -> tuple[Counter, dict]:
    """Votes per answer (abstentions left out) and whether each answer is correct (all its samples are)."""
    votes: Counter = Counter(a for a in extracted if a is not None)
    ok: dict = {}
    for a, c in zip(extracted, correct):
        if a is not None:
            ok[a] = ok.get(a, True) and bool(c)
    return votes, ok


def maj_at_k_subsets(extracted: Sequence[Optional[Hashable]], correct: Sequence[bool], k: int) -> float:
    """Exact mean of :func:`_vote` over all ``C(n, k)`` k-subsets of the samples, without enumerating them.

    With ``m_a`` samples of answer ``a`` and ``m_0`` abstentions, answer ``j`` wins a subset with
    ``v`` votes, tied with ``t`` other answers, in
    ``C(m_j, v) · [x^(k-v) y^t] C_0(x) · Π_{i≠j} (Σ_{u<v} C(m_i, u) x^u + C(m_i, v) x^v y)``
    subsets (``C_0(x) = Σ_u C(m_0, u) x^u``: abstentions never vote), each scoring ``1/(1+t)``.
    Summed over the correct answers j and ``v = 1..min(m_j, k)``, divided by ``C(n, k)``.
    Cost: O(k · Σ_i min(m_i, k)) array operations per correct answer; float64 (exact counts up to 2^53).
    """
    n = len(extracted)
    counts, ok = _tally(extracted, correct)
    m0 = n - sum(counts.values())
    labels = list(counts)
    T = len(labels)  # ties with t <= T - 1 other answers
    total = 0.0
    for j in labels:
        if not ok[j]:
            continue
        others = [counts[i] for i in labels if i != j]
        for v in range(1, min(counts[j], k) + 1):
            room = k - v  # samples left for abstentions and the other answers
            poly = np.zeros((room + 1, T))  # poly[s, t]: ways to pick s more samples with t ties at v
            poly[0, 0] = 1.0
            if m0:
                poly = _times(poly, [math.comb(m0, u) for u in range(min(m0, room) + 1)], None)
            for m in others:
                below = [math.comb(m, u) for u in range(min(m, v - 1, room) + 1)]
                tie = math.comb(m, v) if v <= min(m, room) else 0.0
                poly = _times(poly, below, (v, tie))
            ties = poly[room]
            total += math.comb(counts[j], v) * float(np.sum(ties / np.arange(1, T + 1)))
    return total / math.comb(n, k)


def _times(poly: np.ndarray, coef: Sequence[float], tie: Optional[tuple[int, float]]) -> np.ndarray:
    """poly(x, y) · (Σ_u coef[u] x^u + tie_c · x^v · y), truncated to the array's x degree."""
    out = np.zeros_like(poly)
    S = poly.shape[0]
    for u, c in enumerate(coef):
        if u >= S:
            break
        if c:
            out[u:] += c * poly[: S - u]
    if tie is not None and tie[1] and tie[0] < S:
        v, c = tie
        out[v:, 1:] += c * poly[: S - v, :-1]
    return out


def accuracy_bin(c: int, n: int) -> int:
    """Index into :data:`ACC_BIN_LABELS` for a problem with ``c`` of ``n`` samples correct: bin 0 is exactly 0,
    bin 11 exactly 1, bin ``i`` in 1..10 holds ``((i-1)/10, i/10]`` (bin 10: ``(0.9, 1)``).  Exact integer
    arithmetic (``ceil(10 c / n)``), so 3/10 lands in ``(0.2,0.3]``."""
    n, c = _check_int("n", n), _check_int("c", c)
    if n < 1 or not 0 <= c <= n:
        raise ValueError(f"need n >= 1 and 0 <= c <= n, got c={c}, n={n}")
    if c == 0:
        return 0
    if c == n:
        return 11
    return min(10, -(-10 * c // n))


def accuracy_histogram(counts: Sequence[tuple[int, int]]) -> list[int]:
    """Histogram (12 bins, see :data:`ACC_BIN_LABELS`) of ``(c, n)`` pairs, one per problem."""
    hist = [0] * len(ACC_BIN_LABELS)
    for c, n in counts:
        hist[accuracy_bin(c, n)] += 1
    return hist


def answer_entropy(extracted: Sequence[Optional[Hashable]]) -> Optional[float]:
    """Shannon entropy (bits) of the distribution of unique extracted answers (or answer classes) of one problem.
    Abstentions (``None``) are left out; ``None`` when every sample abstains (the entropy is undefined)."""
    votes = Counter(a for a in extracted if a is not None)
    total = sum(votes.values())
    if total == 0:
        return None
    return max(0.0, -sum(v / total * math.log2(v / total) for v in votes.values()))  # 0.0, never -0.0


def solved(c: int, n: int, extracted: Sequence[Optional[str]], correct: Sequence[bool], rule: str) -> bool:
    """Whether a model solves a problem under a solve rule (for progressions): ``any``, at least one of the n
    samples is correct; ``majority``, more than half are; ``vote``, the maj@n vote over all samples is correct
    with no tie involving a wrong answer (maj@n score == 1)."""
    if rule == "any":
        return c > 0
    if rule == "majority":
        return 2 * c > n
    if rule == "vote":
        return _vote(extracted, correct) == 1.0
    raise ValueError(f"unknown solve rule {rule!r}; use one of {', '.join(SOLVE_RULES)}")


def mean_or_none(xs: Iterable[Optional[float]]) -> Optional[float]:
    """Mean of the non-None values, or None if there are none."""
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


def pareto_front(points: dict[str, tuple[float, float]]) -> dict[str, list[str]]:
    """Which models dominate which, on two metrics to maximize (e.g. pass@1 against pass@K).

    points: label -> (x, y).  Returns label -> the labels that dominate it: at least as good on both
    metrics and better on one.  The front is the labels with an empty list; equal points do not
    dominate each other, so both stay on the front.
    """
    return {
        a: [b for b, (xb, yb) in points.items() if xb >= xa and yb >= ya and (xb > xa or yb > ya)]
        for a, (xa, ya) in points.items()
    }
