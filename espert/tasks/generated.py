"""Generated tasks, no data files: ``countdown`` problems solvable by construction and ``arithmetic``.

Both are deterministic in their seed (``random.Random``), and their splits are disjoint the way the
``copy`` task's are: a problem belongs to the held-out pool iff ``crc32(key) % 5 == 0``; ``train``
draws only from the rest (seed 0), ``test`` only from the pool (seed 1).

Both have a difficulty ladder, named ``NAME@LEVEL`` (``arithmetic@4``, ``countdown@2``):
:data:`ARITHMETIC_LEVELS` turns the digits, the operation mix and the terms, :data:`COUNTDOWN_LEVELS` the
numbers in the pool and their range.  ``arithmetic`` is ``arithmetic@1`` and ``countdown`` is
``countdown@4``, problem for problem.  ``espert calibrate`` finds the level a base model can learn.
"""

from __future__ import annotations

import random
import zlib
from fractions import Fraction
from typing import Optional

from .base import Task
from .rewards import builtin_task, countdown_answer

COUNTDOWN_PROMPT = (
    "Using the numbers {numbers}, create an equation that equals {target}. You can use basic "
    "arithmetic operations (+, -, *, /) and each number can only be used once. Show your work in "
    "<think> </think> tags. And return the final answer in <answer> </answer> tags, for example "
    "<answer> (1 + 2) / 3 </answer>."
)

SPLIT_SEEDS = {"train": 0, "test": 1}
DEFAULT_SIZES = {"train": 1024, "test": 256}
_SPLIT_ALIASES = {"validation": "test", "heldout": "test", "held-out": "test"}


def split_size_seed(task: str, split: str, n: Optional[int], seed: Optional[int]) -> tuple[str, int, int]:
    """A generated task's ``(split, n, seed)``: aliases resolved, the split's default size and seed where None."""
    split = _SPLIT_ALIASES.get(split, split)
    if split not in SPLIT_SEEDS:
        raise ValueError(f"{task} task: unknown split {split!r} (use 'train' or 'test')")
    return split, DEFAULT_SIZES[split] if n is None else n, SPLIT_SEEDS[split] if seed is None else seed


def is_heldout(key: str) -> bool:
    """Whether a generated problem (by its canonical key) belongs to the held-out pool."""
    return zlib.crc32(key.encode("utf-8")) % 5 == 0


def _draw(n: int, seed: int, heldout: bool, make, task: str, max_tries: int = 200) -> list:
    """``n`` distinct problems from ``make(rng) -> (key, problem) | None`` in the given pool."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    seen: set[str] = set()
    out = []
    misses = 0
    while len(out) < n:
        got = make(rng)
        if got is None or got[0] in seen or is_heldout(got[0]) != heldout:
            misses += 1
            if misses > max_tries * (n + 1):
                raise ValueError(f"{task} task: cannot draw {n} distinct problems with these settings (got {len(out)})")
            continue
        seen.add(got[0])
        out.append(got[1])
    return out


# --------------------------------------------------------------------------- the ladder

#: arithmetic@L: the knobs of level L (1-based), easiest first.  Level 1 is the plain ``arithmetic`` task;
#: a 0.5 B instruct model solves it (reward 1.0), so the ladder climbs from there.
ARITHMETIC_LEVELS = (
    dict(digits=2, ops="+", terms=2),  # 47 + 38
    dict(digits=2, ops="+-", terms=2),  # 47 - 38
    dict(digits=3, ops="+-", terms=2),  # 471 - 389
    dict(digits=2, ops="*", terms=2),  # 47 * 38
    dict(digits=2, ops="+-*", terms=3),  # 47 - 38 * 12
    dict(digits=3, ops="*", terms=2),  # 471 * 389
)
#: countdown@L: the knobs of level L (1-based), easiest first: how many numbers, how large, how large the
#: target.  Level 4 is the plain ``countdown`` task (ES-at-Scale's 3-4 numbers).
COUNTDOWN_LEVELS = (
    dict(min_numbers=3, max_numbers=3, max_number=10, max_target=100),
    dict(min_numbers=3, max_numbers=3, max_number=30, max_target=200),
    dict(min_numbers=3, max_numbers=3, max_number=99, max_target=999),
    dict(min_numbers=3, max_numbers=4, max_number=99, max_target=999),
    dict(min_numbers=4, max_numbers=4, max_number=99, max_target=999),
    dict(min_numbers=5, max_numbers=5, max_number=99, max_target=999),
)
#: Task name -> its ladder.
LEVELS = {"arithmetic": ARITHMETIC_LEVELS, "countdown": COUNTDOWN_LEVELS, "countdown_format": COUNTDOWN_LEVELS}


def level_knobs(task: str, level: int) -> dict:
    """The generator's keyword arguments of ``task`` (a canonical name) at ``level`` (1-based); ValueError in
    one line for a task without a ladder or a level outside it."""
    if task not in LEVELS:
        raise ValueError(f"task {task} has no difficulty levels (these have: {', '.join(LEVELS)})")
    ladder = LEVELS[task]
    if not 1 <= level <= len(ladder):
        raise ValueError(f"task {task} has levels 1 to {len(ladder)}, got {level}")
    return dict(ladder[level - 1])


# --------------------------------------------------------------------------- countdown

COUNTDOWN_MIN_NUMBERS, COUNTDOWN_MAX_NUMBERS = 3, 4
COUNTDOWN_MAX_NUMBER = 99
COUNTDOWN_MAX_TARGET = 999


def _countdown_one(rng: random.Random, min_numbers: int, max_numbers: int, max_number: int, max_target: int):
    """One problem: numbers, then random binary operations joining two of the remaining expressions
    (``/`` only when exact) until one expression is left; its value is the target when it is a whole
    number in ``1..max_target``, else the draw is rejected (None)."""
    k = rng.randint(min_numbers, max_numbers)
    numbers = [rng.randint(1, max_number) for _ in range(k)]
    items = [(Fraction(x), str(x)) for x in numbers]
    while len(items) > 1:
        i, j = rng.sample(range(len(items)), 2)
        (a, ea), (b, eb) = items[i], items[j]
        op = rng.choice("+-*/")
        if op == "/" and (b == 0 or (a / b).denominator != 1):
            op = rng.choice("+-*")
        v = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else None}[op]
        items = [it for t, it in enumerate(items) if t not in (i, j)] + [(v, f"({ea} {op} {eb})")]
    value, expr = items[0]
    if value.denominator != 1 or not (1 <= value <= max_target):
        return None
    expr = expr[1:-1] if expr.startswith("(") else expr
    key = f"{sorted(numbers)}={int(value)}"
    return key, (numbers, int(value), expr)


def generate_countdown(
    n: int,
    seed: int,
    heldout: bool,
    min_numbers: int = COUNTDOWN_MIN_NUMBERS,
    max_numbers: int = COUNTDOWN_MAX_NUMBERS,
    max_number: int = COUNTDOWN_MAX_NUMBER,
    max_target: int = COUNTDOWN_MAX_TARGET,
) -> list[tuple[list[int], int, str]]:
    """``n`` distinct countdown problems ``(numbers, target, a solution)`` (distinct as number multiset
    and target), each solvable by construction: the solution uses every number once."""
    if not (2 <= min_numbers <= max_numbers) or max_number < 1 or max_target < 1:
        raise ValueError("countdown task needs 2 <= min_numbers <= max_numbers, max_number >= 1, max_target >= 1")
    return _draw(
        n, seed, heldout, lambda rng: _countdown_one(rng, min_numbers, max_numbers, max_number, max_target), "countdown"
    )


def make_countdown_task(
    n: Optional[int] = None,
    split: str = "train",
    seed: Optional[int] = None,
    name: str = "countdown",
    level: Optional[int] = None,
    **kw,
) -> Task:
    """The generated ``countdown`` task (3-4 numbers in 1..99, a target in 1..999; ``**kw``: see
    :func:`generate_countdown`; ``level``: the knobs of :data:`COUNTDOWN_LEVELS`).  ``name`` picks the
    reward: ``countdown`` (0/1) or ``countdown_format``."""
    split, n, s = split_size_seed("countdown", split, n, seed)
    if level is not None:
        kw = {**level_knobs("countdown", level), **kw}
    probs = generate_countdown(n, s, heldout=(split == "test"), **kw)
    prompts = [COUNTDOWN_PROMPT.format(numbers=nums, target=t) for nums, t, _ in probs]
    answers = [countdown_answer(t, nums) for nums, t, _ in probs]
    meta = {"source": "generated", "split": split, "seed": s, **kw}
    return builtin_task(name, prompts, answers, meta if level is None else {**meta, "level": level})


# --------------------------------------------------------------------------- arithmetic

ARITHMETIC_PROMPT = "{expr} ="
ARITHMETIC_OPS = "+"
ARITHMETIC_DIGITS = 2


def _arithmetic_one(rng: random.Random, digits: int, ops: str, terms: int):
    lo, hi = 10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1
    xs = [rng.randint(lo, hi) for _ in range(terms)]
    os_ = [rng.choice(ops) for _ in range(terms - 1)]
    expr = " ".join([str(xs[0]), *(f"{o} {x}" for o, x in zip(os_, xs[1:]))])
    return expr, (expr, _eval_int(xs, os_))


def _eval_int(xs: list[int], ops: list[str]) -> int:
    """Value of ``x0 o1 x1 o2 x2 ...`` with the usual precedence (``*`` before ``+ -``)."""
    terms, cur = [], xs[0]
    for o, x in zip(ops, xs[1:]):
        if o == "*":
            cur *= x
        else:
            terms.append(cur)
            terms.append(o)
            cur = x
    terms.append(cur)
    total = terms[0]
    for i in range(1, len(terms), 2):
        total = total + terms[i + 1] if terms[i] == "+" else total - terms[i + 1]
    return total


def generate_arithmetic(
    n: int, seed: int, heldout: bool, digits: int = ARITHMETIC_DIGITS, ops: str = ARITHMETIC_OPS, terms: int = 2
) -> list[tuple[str, int]]:
    """``n`` distinct problems ``(expression, value)``: ``terms`` integers of ``digits`` digits joined by
    operators drawn from ``ops`` (any of ``+ - *``), evaluated with the usual precedence."""
    if digits < 1 or terms < 2 or not ops or set(ops) - set("+-*"):
        raise ValueError(
            f"arithmetic task needs digits >= 1, terms >= 2 and ops from '+-*', got {digits}, {terms}, {ops!r}"
        )
    return _draw(n, seed, heldout, lambda rng: _arithmetic_one(rng, digits, ops, terms), "arithmetic")


def make_arithmetic_task(
    n: Optional[int] = None,
    split: str = "train",
    seed: Optional[int] = None,
    digits: int = ARITHMETIC_DIGITS,
    ops: str = ARITHMETIC_OPS,
    terms: int = 2,
    level: Optional[int] = None,
) -> Task:
    """The generated ``arithmetic`` task: prompt ``"47 + 38 ="``, answer ``"85"``.  The difficulty knobs
    are ``digits`` (per operand), ``ops`` (``"+"``, ``"+-"``, ``"+-*"``...) and ``terms`` (operands), or
    ``level``, which sets all three from :data:`ARITHMETIC_LEVELS`."""
    split, n, s = split_size_seed("arithmetic", split, n, seed)
    if level is not None:
        digits, ops, terms = (level_knobs("arithmetic", level)[k] for k in ("digits", "ops", "terms"))
    probs = generate_arithmetic(n, s, heldout=(split == "test"), digits=digits, ops=ops, terms=terms)
    meta = {"source": "generated", "split": split, "seed": s, "digits": digits, "ops": ops, "terms": terms}
    if level is not None:
        meta["level"] = level
    return builtin_task(
        "arithmetic", [ARITHMETIC_PROMPT.format(expr=e) for e, _ in probs], [str(v) for _, v in probs], meta
    )
