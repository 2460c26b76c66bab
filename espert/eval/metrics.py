"""Evaluation metrics: pass@k, maj@k, accuracy histogram, answer entropy, progressions.

All definitions are documented in ``docs/eval.md`` and are exactly what is implemented
here. Inputs are per-problem lists of per-sample correctness flags and extracted answers.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Optional, Sequence

#: Labels of the 12 accuracy-histogram bins (per-problem fraction of correct samples).
ACC_BIN_LABELS = ["0", "(0,0.1]", "(0.1,0.2]", "(0.2,0.3]", "(0.3,0.4]", "(0.4,0.5]",
                  "(0.5,0.6]", "(0.6,0.7]", "(0.7,0.8]", "(0.8,0.9]", "(0.9,1)", "1"]

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
    ks = []
    k = 1
    while k <= n:
        ks.append(k)
        k *= 2
    if ks[-1] != n:
        ks.append(n)
    return ks


def maj_at_k(extracted: Sequence[Optional[str]], correct: Sequence[bool], k: int) -> float:
    """Majority-vote score over the first ``k`` samples of one problem.

    * Votes are the extracted answers of samples ``0..k-1``; ``None`` (failed
      extraction) abstains. If every sample abstains the score is 0.
    * An answer is *correct* iff every one of its voting samples is correct (for the
      built-in tasks correctness depends only on the extracted answer, so all agree).
    * The plurality answer wins. On a tie between ``t`` answers the score is the
      fraction of the tied answers that are correct (the expected score of breaking the
      tie uniformly at random): e.g. 1 correct vs 1 wrong answer with 2 votes each -> 0.5.
    """
    k = _check_int("k", k)
    if len(extracted) != len(correct):
        raise ValueError(f"{len(extracted)} extracted answers but {len(correct)} correctness flags")
    if not 1 <= k <= len(extracted):
        raise ValueError(f"k={k} must be in [1, n={len(extracted)}]")
    votes: Counter = Counter()
    ans_correct: dict[str, bool] = {}
    for a, ok in zip(extracted[:k], correct[:k]):
        if a is None:
            continue
        votes[a] += 1
        ans_correct[a] = ans_correct.get(a, True) and bool(ok)
    if not votes:
        return 0.0
    top = max(votes.values())
    tied = [a for a, v in votes.items() if v == top]
    return sum(1 for a in tied if ans_correct[a]) / len(tied)


def accuracy_bin(c: int, n: int) -> int:
    """Index into :data:`ACC_BIN_LABELS` for a problem with ``c`` of ``n`` samples correct.

    Bin 0 is exactly 0, bin 11 is exactly 1; bin ``i`` in 1..10 holds fractions in
    ``((i-1)/10, i/10]`` except bin 10, which is ``(0.9, 1)``. Computed in exact integer
    arithmetic (``ceil(10 c / n)``), so 3/10 lands in ``(0.2,0.3]``.
    """
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


def answer_entropy(extracted: Sequence[Optional[str]]) -> Optional[float]:
    """Shannon entropy (bits) of the distribution of unique extracted answers of one problem.

    Abstentions (``None``) are excluded from the distribution. Returns ``None`` when every
    sample abstains (entropy undefined; such problems are left out of means and counted
    separately).
    """
    votes = Counter(a for a in extracted if a is not None)
    total = sum(votes.values())
    if total == 0:
        return None
    h = 0.0
    for v in votes.values():
        p = v / total
        h -= p * math.log2(p)
    return max(h, 0.0)


def solved(c: int, n: int, extracted: Sequence[Optional[str]], correct: Sequence[bool], rule: str) -> bool:
    """Whether a model solves a problem under a solve rule (used for progressions).

    * ``any`` (default): at least one of the n samples is correct (c > 0).
    * ``majority``: strictly more than half of the samples are correct (c / n > 0.5).
    * ``vote``: the maj@n vote over all samples is correct with no tie involving a wrong
      answer (maj@n score == 1).
    """
    if rule == "any":
        return c > 0
    if rule == "majority":
        return 2 * c > n
    if rule == "vote":
        return maj_at_k(extracted, correct, len(extracted)) == 1.0
    raise ValueError(f"unknown solve rule {rule!r}; use one of {', '.join(SOLVE_RULES)}")


def mean_or_none(xs: Sequence[Optional[float]]) -> Optional[float]:
    """Mean of the non-None values, or None if there are none."""
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None
