"""Reward functions and answer extractors for the built-in tasks.

Every reward here is *batched*: ``reward(completions, answers) -> list[float]`` with
values in ``[0, 1]``. Every extractor returns a normalized answer string or ``None``
when no answer can be extracted. Exact definitions are in ``docs/eval.md``.

* GSM8K: the number after the last ``####`` (fallback: the last number in the text,
  see :func:`gsm8k_extract`), compared exactly as rationals after removing ``,`` and ``$``.
* MATH: the content of the last ``\\boxed{...}`` (nested braces handled), equal after LaTeX
  normalization or equivalent by ``math_verify`` (``parse`` + ``verify``), which ``math500`` requires
  (it refuses to start without it).  ``math500_string`` asks for the normalized string comparison
  alone, on purpose.
* Countdown: an arithmetic expression in the last ``<answer>...</answer>`` block that
  uses exactly the given numbers, each once, with ``+ - * /`` and parentheses only and
  evaluates exactly (rational arithmetic) to the target. Parsed with :mod:`ast`, never
  evaluated with ``eval``.
* countdown_format: ES-at-Scale's reward, ``(0.1 * format + correct) / 1.1`` (see
  :func:`countdown_format_reward`).
* arithmetic: the integer after the last ``=`` of the completion's first line (else that line's last
  integer) equals the reference.
* humaneval, mbpp: the completion's code passes the problem's tests in :mod:`espert.jail.sandbox`.
* copy: partial credit, fraction of the first ``len(answer)`` non-whitespace characters
  that match the answer position by position.
"""

from __future__ import annotations

import ast
import json
import operator
import re
import threading
from collections import Counter
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Callable, Optional, Sequence

from espert.extras import require

from .base import Task
from .code import code_extract, humaneval_reward, mbpp_reward

# --------------------------------------------------------------------------- GSM8K

_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+|/\d+)?|-?\.\d+")


def parse_number(text: str) -> Optional[Fraction]:
    """Parse a number such as ``"1,234.50"``, ``"$18"``, ``"-3"`` or ``"3/4"`` into an exact Fraction.

    Commas, ``$`` signs, spaces and a trailing ``.`` are removed first. Returns ``None``
    if the text is not a single number.
    """
    s = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    if not s:
        return None
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    if m:
        return Fraction(int(m.group(1)), int(m.group(2))) if int(m.group(2)) != 0 else None
    try:
        return Fraction(Decimal(s))
    except (InvalidOperation, ValueError):
        return None


def format_number(x: Fraction) -> str:
    """Canonical string of an exact number: ``"18"``, ``"-0.5"``, ``"1/3"``."""
    if x.denominator == 1:
        return str(x.numerator)
    d = x.denominator
    while d % 2 == 0:
        d //= 2
    while d % 5 == 0:
        d //= 5
    if d == 1:  # terminating decimal
        s = format(Decimal(x.numerator) / Decimal(x.denominator), "f")
        return s.rstrip("0").rstrip(".") if "." in s else s
    return f"{x.numerator}/{x.denominator}"


def gsm8k_extract(completion: str, *, fallback_last_number: bool = True) -> Optional[str]:
    """Final numeric answer of a GSM8K-style completion, canonicalized (e.g. ``"1000"``).

    The answer is the first number after the *last* ``####`` marker. If there is no
    ``####`` (or no number after it) and ``fallback_last_number`` is true (the default
    for the ``gsm8k`` task), the last number anywhere in the completion is used.
    Returns ``None`` if no number is found.  ``fallback_last_number`` is keyword-only: a second
    positional argument (a task passing the reference answer to its extractor) must not switch
    the fallback off.
    """
    if not isinstance(completion, str):
        return None
    found = _NUMBER_RE.search(completion.rsplit("####", 1)[1].replace("$", "")) if "####" in completion else None
    candidates = [found.group(0)] if found else []
    if fallback_last_number:
        candidates += _NUMBER_RE.findall(completion.replace("$", ""))[-1:]
    for text in candidates:
        v = parse_number(text)
        if v is not None:
            return format_number(v)
    return None


def gsm8k_gold(answer: str) -> Optional[Fraction]:
    """Reference value of a GSM8K answer: the text after ``####`` or a plain number."""
    s = answer.rsplit("####", 1)[1] if "####" in answer else answer
    v = parse_number(s)
    if v is None:
        m = _NUMBER_RE.findall(s.replace("$", ""))
        if m:
            v = parse_number(m[-1])
    return v


def gsm8k_reward(completions: Sequence[str], answers: Sequence[str], fallback_last_number: bool = True) -> list[float]:
    """Batched GSM8K reward: 1.0 if the extracted number equals the reference exactly."""
    out = []
    for c, a in zip(completions, answers):
        gold = gsm8k_gold(a)
        if gold is None:
            raise ValueError(f"GSM8K reference answer has no number: {a!r}")
        pred = gsm8k_extract(c, fallback_last_number=fallback_last_number)
        out.append(1.0 if pred is not None and parse_number(pred) == gold else 0.0)
    return out


def gsm8k_reward_strict(completions: Sequence[str], answers: Sequence[str]) -> list[float]:
    """GSM8K reward that only accepts an answer written after ``####`` (no fallback)."""
    return gsm8k_reward(completions, answers, fallback_last_number=False)


def gsm8k_extract_strict(completion: str) -> Optional[str]:
    """:func:`gsm8k_extract` without the last-number fallback."""
    return gsm8k_extract(completion, fallback_last_number=False)


def gsm8k_equal(a: str, b: str) -> bool:
    """Numeric equivalence of two extracted GSM8K answers (``"0.5"``, ``"1/2"``, ``"$0.50"`` are equal)."""
    x, y = parse_number(a), parse_number(b)
    return a == b if x is None or y is None else x == y


# --------------------------------------------------------------------------- MATH

_BOXED_MARKERS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``.

    Nested braces are matched, so ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``. The
    brace-less form ``\\boxed 5`` gives ``5``. Returns ``None`` if there is no box or
    its braces are unbalanced.
    """
    if not isinstance(text, str):
        return None
    pos = max(text.rfind(m) for m in _BOXED_MARKERS)
    while pos >= 0:
        marker = next(m for m in _BOXED_MARKERS if text.startswith(m, pos))
        i = pos + len(marker)
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                ch = text[j]
                if ch == "{" and (j == 0 or text[j - 1] != "\\"):
                    depth += 1
                elif ch == "}" and (j == 0 or text[j - 1] != "\\"):
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j].strip()
            return None  # unbalanced
        if i < len(text) and text[i] == " ":
            m = re.match(r"\s+([^\s$]+)", text[i:])
            if m:
                return m.group(1).rstrip(".")
        # e.g. "\boxedx" is not a box: look for an earlier one
        pos = max(text.rfind(m, 0, pos) for m in _BOXED_MARKERS)
    return None


def normalize_latex(s: str) -> str:
    """String normalization used for MATH voting and as the fallback comparison.

    Removes ``$``, spaces, ``\\left``/``\\right``, thin spaces, ``^\\circ``, ``\\%``/``%``,
    ``\\text{...}`` wrappers, a leading ``x=``, and a trailing period; maps
    ``\\dfrac``/``\\tfrac`` to ``\\frac``.
    """
    s = s.strip()
    s = s.replace("\\left", "").replace("\\right", "")
    for t in ("\\!", "\\,", "\\;", "\\:", "\\ ", "$"):
        s = s.replace(t, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\circ", "")
    s = s.replace("\\%", "").replace("%", "")
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"^[a-zA-Z]=", "", s)
    s = s.rstrip(".")
    return s


def math_extract(completion: str) -> Optional[str]:
    """Normalized content of the last ``\\boxed{}`` (``None`` if there is none or it is empty)."""
    b = last_boxed(completion)
    if b is None:
        return None
    n = normalize_latex(b)
    return n or None


def _math_gold(answer: str) -> str:
    b = last_boxed(answer) if any(m in answer for m in _BOXED_MARKERS) else None
    return b if b is not None else answer.strip()


def math_equal(gold: str, pred: str) -> bool:
    """Whether ``pred`` is mathematically equivalent to ``gold`` (both raw LaTeX strings).

    Equal :func:`normalize_latex` strings are always equivalent; otherwise ``math_verify.parse`` on
    ``\\boxed{...}``-wrapped strings and ``math_verify.verify`` decide, and a side math_verify cannot
    parse (or a math_verify error) is not equivalent.  Without math_verify installed this raises
    :class:`espert.extras.MissingExtra`: a silent string fallback would grade ``\\frac{1}{2}`` against
    ``0.5`` differently from a machine that has it.  :func:`math_string_equal` is the string rule.
    """
    if math_string_equal(gold, pred):
        return True
    require("math_verify", "MATH grading (math500)", "or use --task math500_string for plain string grading")
    from math_verify import parse, verify

    try:
        # math_verify's timeout uses SIGALRM, which only works in the main thread.
        timeout = 5 if threading.current_thread() is threading.main_thread() else None
        g = parse("\\boxed{" + gold + "}", parsing_timeout=timeout, raise_on_error=True)
        p = parse("\\boxed{" + pred + "}", parsing_timeout=timeout, raise_on_error=True)
        if not g or not p:
            return False  # unparsable: the string comparison above already failed
        return bool(verify(g, p, timeout_seconds=timeout, raise_on_error=True))
    except Exception:  # noqa: BLE001 - math_verify failed on this pair: not shown equivalent
        return False


def math_string_equal(gold: str, pred: str) -> bool:
    """``math500_string``'s rule: equal, non-empty :func:`normalize_latex` strings."""
    ng = normalize_latex(gold)
    return bool(ng) and ng == normalize_latex(pred)


def _boxed_reward(completions: Sequence[str], answers: Sequence[str], equal: Callable) -> list[float]:
    out = []
    for c, a in zip(completions, answers):
        pred = last_boxed(c)
        if pred is None or not pred.strip():
            out.append(0.0)
            continue
        out.append(1.0 if equal(_math_gold(a), pred) else 0.0)
    return out


def math_reward(completions: Sequence[str], answers: Sequence[str]) -> list[float]:
    """Batched MATH reward: 1.0 if the last ``\\boxed{}`` is equivalent to the reference (:func:`math_equal`).

    The reference may be a bare LaTeX answer (MATH-500 ``answer`` field) or a full
    solution containing ``\\boxed{}``.
    """
    return _boxed_reward(completions, answers, math_equal)


def math_string_reward(completions: Sequence[str], answers: Sequence[str]) -> list[float]:
    """``math500_string``: :func:`math_reward` with :func:`math_string_equal` (no math_verify)."""
    return _boxed_reward(completions, answers, math_string_equal)


# --------------------------------------------------------------------------- Countdown

_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
_MAX_EXPR_CHARS = 512
_MAX_EXPR_NODES = 64
_MAX_ABS_VALUE = 10**30
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def countdown_answer(target: int, numbers: Sequence[int]) -> str:
    """Encode a Countdown problem as the reference-answer string used by this module."""
    return json.dumps({"target": int(target), "numbers": [int(x) for x in numbers]})


def countdown_gold(answer: str) -> tuple[int, list[int]]:
    """Decode a Countdown reference answer ``{"target": T, "numbers": [...]}`` (``nums`` also accepted)."""
    try:
        d = json.loads(answer)
        target = d["target"]
        nums = d["numbers"] if "numbers" in d else d["nums"]
        return int(target), [int(x) for x in nums]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f'Countdown reference answer must be JSON {{"target": int, "numbers": [int, ...]}}, got {answer!r} ({e})'
        ) from None


def countdown_extract(completion: str) -> Optional[str]:
    """The expression in the last ``<answer>...</answer>`` block, whitespace removed.

    A trailing ``= value`` is dropped (``"(1+2)*4 = 12"`` -> ``"(1+2)*4"``) and the
    Unicode operators ``× ÷ −`` are mapped to ``* / -``. Returns ``None`` if there is
    no answer block or it is empty.
    """
    if not isinstance(completion, str):
        return None
    blocks = _ANSWER_TAG_RE.findall(completion)
    if not blocks:
        return None
    expr = blocks[-1]
    expr = expr.replace("×", "*").replace("÷", "/").replace("−", "-")
    expr = expr.split("=", 1)[0]
    expr = re.sub(r"\s+", "", expr)
    return expr or None


class _CountdownError(ValueError):
    pass


def countdown_evaluate(expr: str) -> tuple[Fraction, list[int]]:
    """Safely evaluate an arithmetic expression with :mod:`ast` and exact fractions.

    Only non-negative integer literals, binary ``+ - * /`` and parentheses are allowed
    (no unary minus, no floats, no names, no calls, no ``**``). Returns the value and the
    list of integer literals used. Raises ``ValueError`` for anything else, including
    division by zero.
    """
    if len(expr) > _MAX_EXPR_CHARS:
        raise _CountdownError("expression too long")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as e:
        raise _CountdownError(f"syntax error: {e.msg}") from None
    nodes = sum(1 for _ in ast.walk(tree))
    if nodes > _MAX_EXPR_NODES:
        raise _CountdownError("expression too large")
    used: list[int] = []

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant):
            v = node.value
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise _CountdownError(f"literal {v!r} is not a non-negative integer")
            used.append(v)
            return Fraction(v)
        if isinstance(node, ast.BinOp):
            left, right = ev(node.left), ev(node.right)
            if type(node.op) not in _OPERATORS:
                raise _CountdownError(f"operator {type(node.op).__name__} not allowed")
            if isinstance(node.op, ast.Div) and right == 0:
                raise _CountdownError("division by zero")
            r = _OPERATORS[type(node.op)](left, right)
            if abs(r.numerator) > _MAX_ABS_VALUE or r.denominator > _MAX_ABS_VALUE:
                raise _CountdownError("intermediate value too large")
            return r
        raise _CountdownError(f"{type(node).__name__} not allowed")

    value = ev(tree.body)
    return value, used


def countdown_check(expr: Optional[str], target: int, numbers: Sequence[int]) -> bool:
    """True if ``expr`` uses exactly ``numbers`` (each once, all of them) and equals ``target``."""
    if not expr:
        return False
    try:
        value, used = countdown_evaluate(expr)
    except _CountdownError:
        return False
    if Counter(used) != Counter(int(n) for n in numbers):
        return False
    return value == Fraction(int(target))


def countdown_reward(completions: Sequence[str], answers: Sequence[str]) -> list[float]:
    """Batched Countdown reward: 1.0 for a valid expression hitting the target, else 0.0."""
    out = []
    for c, a in zip(completions, answers):
        target, nums = countdown_gold(a)
        out.append(1.0 if countdown_check(countdown_extract(c), target, nums) else 0.0)
    return out


#: ES-at-Scale's format check (es_at_scale/reward_function/countdown_grader.py), on ``"<think>" + completion``
#: (their prompt ends with ``<think>``, which the completion does not repeat).
_FULL_FORMAT_RE = re.compile(r"^<think>.*?</think>\n<answer>.*?</answer>$", re.DOTALL)
_THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL)
_ANSWER_RE = re.compile(r"<answer>.*?</answer>", re.DOTALL)
#: The best ES-at-Scale countdown reward: 0.1 * 1.0 (full format) + 1.0 (correct answer).
COUNTDOWN_FORMAT_MAX = 1.1


def countdown_format_score(completion: str) -> float:
    """ES-at-Scale's format score of a completion: 1.0 when ``"<think>" + completion`` is exactly
    ``<think>...</think>\\n<answer>...</answer>``, else 0.1 if it has a ``<think>...</think>`` plus 0.5
    if it has an ``<answer>...</answer>`` (tags case-sensitive, as theirs)."""
    text = "<think>" + completion
    if _FULL_FORMAT_RE.match(text):
        return 1.0
    return (0.1 if _THINK_RE.search(text) else 0.0) + (0.5 if _ANSWER_RE.search(text) else 0.0)


def countdown_format_reward(completions: Sequence[str], answers: Sequence[str]) -> list[float]:
    """ES-at-Scale's countdown reward, ``0.1 * format + correct``, divided by 1.1 to lie in [0, 1].

    ``format`` is :func:`countdown_format_score` (their format credit, exactly); ``correct`` is this
    module's 0/1 countdown check (exact, ``ast``-based; theirs uses ``eval`` with a 1e-5 tolerance).
    Z-score and rank normalizations do not see the 1/1.1 scale.  A correct answer scores at least
    ``1/1.1`` and a wrong one at most ``0.1/1.1``: the task's success threshold is ``1/1.1``.
    """
    correct = countdown_reward(completions, answers)
    return [(0.1 * countdown_format_score(c) + r) / COUNTDOWN_FORMAT_MAX for c, r in zip(completions, correct)]


# --------------------------------------------------------------------------- arithmetic

_INT_RE = re.compile(r"-?\d+")


def arithmetic_extract(completion: str) -> Optional[str]:
    """The integer answer of an arithmetic completion: on its first non-blank line, the integer right
    after the last ``=`` (``"47 + 38 = 85"``), else the line's last integer (``"85"``, ``"It is 85."``).
    Commas are removed first; ``None`` if there is none."""
    if not isinstance(completion, str):
        return None
    line = next((ln for ln in completion.splitlines() if ln.strip()), "").replace(",", "")
    if "=" in line:
        m = _INT_RE.match(line.rsplit("=", 1)[1].strip())
        if m:
            return str(int(m.group(0)))
    found = _INT_RE.findall(line)
    return str(int(found[-1])) if found else None


def arithmetic_reward(completions: Sequence[str], answers: Sequence[str]) -> list[float]:
    """Batched arithmetic reward: 1.0 if :func:`arithmetic_extract` equals the reference integer."""
    out = []
    for c, a in zip(completions, answers):
        pred = arithmetic_extract(c)
        out.append(1.0 if pred is not None and int(pred) == int(a) else 0.0)
    return out


# --------------------------------------------------------------------------- answer equivalence

#: The answer equivalence of each built-in task, used to group extracted answers before majority
#: voting (maj@k) and for the answer entropy.  Tasks not listed compare extracted strings.
ANSWER_EQUIVALENCE = {
    "gsm8k": gsm8k_equal,
    "gsm8k_strict": gsm8k_equal,
    "math500": math_equal,
    "math500_string": math_string_equal,
}


def answer_equivalence(task_name: Optional[str]):
    """``equivalent(a, b) -> bool`` for a task's extracted answers, or ``None`` (string identity).

    GSM8K: exact numeric equality; MATH: :func:`math_equal` (math-verify); others: ``None``.
    """
    try:
        key = canonical_task_name(task_name) if task_name else None
    except ValueError:
        return None
    return ANSWER_EQUIVALENCE.get(key)


def answer_classes(
    extracted: Sequence[Optional[str]], equivalent: Optional[Callable[[str, str], bool]] = None
) -> list[Optional[int]]:
    """Equivalence-class label (0, 1, ...) of each sample's extracted answer; ``None`` stays ``None``.

    Identical strings always share a class.  With ``equivalent(a, b) -> bool`` (the task's own
    equivalence, see :func:`answer_equivalence`) a new string joins the class of
    the first earlier class representative it is equivalent to, so ``\\frac{1}{2}``, ``0.5`` and
    ``1/2`` are one answer on MATH.  Each distinct string is compared once per class (not per sample).
    """
    reps: list[str] = []
    label_of: dict[str, int] = {}
    out: list[Optional[int]] = []
    for a in extracted:
        if a is None:
            out.append(None)
            continue
        if a not in label_of:
            lab = None
            if equivalent is not None:
                lab = next((j for j, r in enumerate(reps) if equivalent(r, a)), None)
            if lab is None:
                reps.append(a)
                lab = len(reps) - 1
            label_of[a] = lab
        out.append(label_of[a])
    return out


# --------------------------------------------------------------------------- copy


def _squash(s: str) -> str:
    return "".join(s.split())


def copy_reward(completions: Sequence[str], answers: Sequence[str]) -> list[float]:
    """Batched copy reward with partial credit.

    All whitespace is removed from the completion; the reward is the fraction of the
    ``len(answer)`` positions where the completion's character equals the answer's
    (missing characters count as wrong; characters past ``len(answer)`` are ignored).
    """
    out = []
    for c, a in zip(completions, answers):
        if not a:
            raise ValueError("copy task: empty reference answer")
        s = _squash(c)
        hits = sum(1 for i, ch in enumerate(a) if i < len(s) and s[i] == ch)
        out.append(hits / len(a))
    return out


def copy_extract(completion: str, answer: Optional[str] = None) -> Optional[str]:
    """First ``len(answer)`` non-whitespace characters of the completion.

    Without ``answer`` the whole whitespace-free completion is returned. ``None`` if empty.
    """
    s = _squash(completion) if isinstance(completion, str) else ""
    if answer is not None:
        s = s[: len(answer)]
    return s or None


#: Reward and extractor of every known task name.
REWARDS: dict[str, tuple[Callable, Callable]] = {
    "gsm8k": (gsm8k_reward, gsm8k_extract),
    "gsm8k_strict": (gsm8k_reward_strict, gsm8k_extract_strict),
    "math500": (math_reward, math_extract),
    "math500_string": (math_string_reward, math_extract),
    "countdown": (countdown_reward, countdown_extract),
    "countdown_format": (countdown_format_reward, countdown_extract),
    "arithmetic": (arithmetic_reward, arithmetic_extract),
    "humaneval": (humaneval_reward, code_extract),
    "mbpp": (mbpp_reward, code_extract),
    "copy": (copy_reward, copy_extract),
}
ALIASES = {
    "math": "math500",
    "math-500": "math500",
    "gsm8k-strict": "gsm8k_strict",
    "math500-string": "math500_string",
    "countdown-format": "countdown_format",
    "human-eval": "humaneval",
}
#: Task variants that read the problems of another task (and only grade differently).
SAME_PROBLEMS = {"gsm8k_strict": "gsm8k", "math500_string": "math500", "countdown_format": "countdown"}
#: Success threshold of the tasks whose correct samples score below 1.0 (default 1.0).
SUCCESS_THRESHOLDS = {"countdown_format": 1.0 / COUNTDOWN_FORMAT_MAX}


def known_tasks() -> list[str]:
    """Names accepted by :func:`load_task` and :func:`reward_task`."""
    return sorted(REWARDS)


def builtin_task(name: str, prompts: Sequence[str], answers: Sequence[str], meta: Optional[dict] = None) -> Task:
    """A :class:`Task` of a known task name: its reward, extractor and success threshold."""
    key = canonical_task_name(name)
    reward, extract = REWARDS[key]
    return Task(key, list(prompts), list(answers), reward, extract, SUCCESS_THRESHOLDS.get(key, 1.0), dict(meta or {}))


def split_level(name: str) -> tuple[str, int | None]:
    """``"arithmetic@3"`` -> ``("arithmetic", 3)``; a name without ``@`` -> ``(name, None)``.  ValueError in one
    line when the level is not a whole number (the range is the generator's: ``generated.level_knobs``)."""
    base, sep, level = name.partition("@")
    if not sep:
        return name, None
    if not level.strip().isdigit():
        raise ValueError(f"task {name!r}: the level must be a whole number (e.g. {base}@2), got {level!r}")
    return base, int(level)


def canonical_task_name(name: str) -> str:
    """Resolve aliases (``math`` -> ``math500``) and drop a level (``arithmetic@3`` -> ``arithmetic``); raise
    ``ValueError`` for unknown names."""
    name = split_level(name)[0]
    key = ALIASES.get(name.lower(), name.lower())
    if key not in REWARDS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(known_tasks())}")
    return key
