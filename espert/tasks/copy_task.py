"""The built-in toy ``copy`` task: repeat a short random letter string.

A prompt is 4-6 random letters from ``"abcdef"`` followed by ``">"`` (e.g. ``"cafe>"``);
the answer is the same letters (``"cafe"``). The reward gives partial credit per
position (:func:`espert.tasks.rewards.copy_reward`), so a tiny randomly initialized
character-level model trained by ES improves smoothly.

Train and held-out splits are disjoint by construction: every possible string is
assigned to the held-out pool iff ``crc32(string) % 5 == 0`` (about 20% of strings),
and the two splits also draw from different seeds. Within a split, strings are unique.
"""

from __future__ import annotations

import random
from typing import Optional

from .base import Task
from .generated import is_heldout, split_size_seed
from .rewards import builtin_task

COPY_ALPHABET = "abcdef"
COPY_MIN_LEN = 4
COPY_MAX_LEN = 6
COPY_SEP = ">"
#: Whether a copy string belongs to the held-out (``test``) pool: the generated tasks' rule.
is_heldout_string = is_heldout


def generate_copy_strings(
    n: int,
    seed: int,
    heldout: Optional[bool],
    alphabet: str = COPY_ALPHABET,
    min_len: int = COPY_MIN_LEN,
    max_len: int = COPY_MAX_LEN,
) -> list[str]:
    """``n`` unique random strings, deterministic in ``seed``.

    ``heldout=True`` keeps only held-out-pool strings, ``False`` only train-pool strings,
    ``None`` keeps everything.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not alphabet or min_len < 1 or max_len < min_len:
        raise ValueError("copy task needs a non-empty alphabet and 1 <= min_len <= max_len")
    space = sum(len(alphabet) ** L for L in range(min_len, max_len + 1))
    # Cap n at half of the (approximate) pool so rejection sampling stays fast.
    limit = {True: space // 10, False: space * 2 // 5, None: space // 2}[heldout]
    if n > limit:
        raise ValueError(f"copy task: n={n} is too large for this alphabet/length range (max {limit})")
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[str] = []
    while len(out) < n:
        L = rng.randint(min_len, max_len)
        s = "".join(rng.choice(alphabet) for _ in range(L))
        if s in seen:
            continue
        if heldout is not None and is_heldout_string(s) != heldout:
            continue
        seen.add(s)
        out.append(s)
    return out


def make_copy_task(
    n: Optional[int] = None,
    split: str = "train",
    seed: Optional[int] = None,
    alphabet: str = COPY_ALPHABET,
    min_len: int = COPY_MIN_LEN,
    max_len: int = COPY_MAX_LEN,
) -> Task:
    """Build the ``copy`` task.

    Args:
        n: number of problems (default 1024 for ``train``, 256 for ``test``).
        split: ``"train"`` or ``"test"`` (held-out; ``"validation"``/``"heldout"`` are aliases).
        seed: override the split's default seed (0 for train, 1 for test). The pool
            restriction still applies, so splits stay disjoint for any seeds.
    """
    split, n, s = split_size_seed("copy", split, n, seed)
    strings = generate_copy_strings(
        n, s, heldout=(split == "test"), alphabet=alphabet, min_len=min_len, max_len=max_len
    )
    meta = {
        "source": "builtin",
        "split": split,
        "seed": s,
        "alphabet": alphabet,
        "min_len": min_len,
        "max_len": max_len,
    }
    return builtin_task("copy", [x + COPY_SEP for x in strings], strings, meta)
