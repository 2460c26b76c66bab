"""Forgetting reports: espert eval over several tasks at once, a report per task and one table of
pass@1, pass@K and maj@K per task for every model with its change against the base (the second seed
paper's Tables 2 and 5)."""

import json
import os
import sys

import pytest

from espert.eval.report import build_report, forgetting
from espert.eval.samples import make_records
from espert.tasks import load_task

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))
from tiny_model import build_tiny_model  # noqa: E402


def test_the_table_on_known_reports():
    copy = load_task("copy", "test", n=2)
    arith = load_task("arithmetic", "test", n=2)
    right = lambda t: [[a, a] for a in t.answers]  # noqa: E731
    half = lambda t: [[a, "x"] for a in t.answers]  # noqa: E731
    wrong = lambda t: [["x", "x"] for _ in t.answers]  # noqa: E731
    reports = {
        "copy": build_report(
            {"base": make_records("base", copy, half(copy)), "es": make_records("es", copy, right(copy))}
        ),
        "arithmetic": build_report(
            {"base": make_records("base", arith, half(arith)), "es": make_records("es", arith, wrong(arith))}
        ),
    }
    doc, text = forgetting(reports, base="base")
    cp, ar = doc["tasks"]["copy"], doc["tasks"]["arithmetic"]
    assert cp["k"] == ar["k"] == 2
    assert cp["models"]["es"]["change"] == {"pass_at_1": 0.5, "pass_at_2": 0.0, "maj_at_2": pytest.approx(0.5)}
    assert ar["models"]["es"]["change"]["pass_at_1"] == -0.5 and ar["models"]["es"]["change"]["pass_at_2"] == -1.0
    assert ar["models"]["base"]["change"]["pass_at_1"] == 0.0
    assert "arithmetic (K=2)  es" in text and "-1.000" in text and "+0.500" in text
    with pytest.raises(ValueError, match="base model 'sft' not among"):
        forgetting(reports, base="sft")


def test_eval_over_several_tasks_writes_a_report_each_and_the_table(tmp_path, capsys):
    from espert.cli import main

    base = build_tiny_model(str(tmp_path / "base"), seed=0)
    other = build_tiny_model(str(tmp_path / "other"), seed=1)
    out = tmp_path / "out"
    argv = ["eval", "--task", "copy", "arithmetic", "--limit", "3", "--models", f"base={base}", f"es={other}"]
    argv += ["-n", "2", "--max-new-tokens", "3", "--no-plots", "--out", str(out)]
    assert main(argv) == 0
    for task in ("copy", "arithmetic"):
        rep = json.load(open(out / task / "report.json"))
        assert rep["task"] == task and set(rep["models"]) == {"base", "es"}
    doc = json.load(open(out / "forgetting.json"))
    assert set(doc["tasks"]) == {"copy", "arithmetic"} and doc["base"] == "base"
    for task, t in doc["tasks"].items():
        rep = json.load(open(out / task / "report.json"))
        got = t["models"]["es"]["change"]["pass_at_1"]
        assert got == pytest.approx(rep["models"]["es"]["pass_at_k"]["1"] - rep["models"]["base"]["pass_at_k"]["1"])
    assert "forgetting: every model on every task" in capsys.readouterr().out
    assert main([*argv[:-1], str(tmp_path / "o2"), "--data", "x.jsonl"]) == 2  # --data goes with one task


def test_each_task_may_bring_its_own_problems_file(tmp_path, capsys):
    """Before: --data served one task only, so a forgetting report could not hold a task trained from a
    local file (two-digit additions graded by the gsm8k rule) next to the built-in held-out tasks."""
    from espert.cli import main

    base = build_tiny_model(str(tmp_path / "base"), seed=0)
    other = build_tiny_model(str(tmp_path / "other"), seed=1)
    probs = tmp_path / "add.jsonl"
    probs.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in (11, 12, 13)))
    out = tmp_path / "out"
    argv = ["eval", "--task", f"gsm8k={probs}", "copy", "--limit", "2", "--models", f"base={base}", f"es={other}"]
    argv += ["-n", "2", "--max-new-tokens", "3", "--no-plots", "--out", str(out)]
    assert main(argv) == 0
    doc = json.load(open(out / "forgetting.json"))
    assert set(doc["tasks"]) == {"gsm8k", "copy"}
    rep = json.load(open(out / "gsm8k" / "report.json"))
    assert rep["task"] == "gsm8k" and rep["models"]["base"]["n_problems"] == 2  # from the file, --limit 2
    capsys.readouterr()
    argv[2] = f"gsm8k={tmp_path / 'missing.jsonl'}"
    assert main([*argv[:-1], str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert "problems file of task 'gsm8k' not found" in err and "Traceback" not in err
    argv[2:4] = ["copy", "copy=" + str(probs)]
    assert main([*argv[:-1], str(tmp_path / "o3")]) == 2
    assert "a task is given twice" in capsys.readouterr().err


def test_the_table_with_one_sample_per_problem():
    """n = 1 (greedy): K = 1, pass@K is pass@1, and every row still has its three columns (an IndexError
    before)."""
    copy = load_task("copy", "test", n=2)
    reports = {"copy": build_report({"base": make_records("base", copy, [["x"], ["y"]]),
                                     "es": make_records("es", copy, [[a] for a in copy.answers])})}  # fmt: skip
    doc, text = forgetting(reports, base="base")
    assert doc["tasks"]["copy"]["models"]["es"]["change"] == {"pass_at_1": 1.0, "maj_at_1": 1.0}
    assert "+1.000" in text.splitlines()[-1]
