"""Custom tasks and rewards (issue 14 §1): from Python, YAML and the CLI, through resume and replay.

Before: train() took no task, a custom reward needed a fake evaluator backend registered in the
user's process, config.yaml recorded ``task: copy``, held-out evaluation scored copy prompts,
and ``espert train --resume`` failed with "unknown evaluator backend".
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import espert
from espert import runs
from espert.cli import main as cli_main
from espert.config import ESConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
# pretrain_steps=0: a random-init tiny base (pretraining costs ~30 s and is not what these tests check)
SMALL = dict(
    pretrain_steps=0,
    iterations=2,
    population=4,
    prompts_per_iteration=4,
    eval_size=4,
    max_new_tokens=2,
    eval_every=1,
    checkpoint_every=1,
)
LETTERS = [a + b + c + ">" for a in "abcdef" for b in "abcdef" for c in "abcdef"]


@pytest.fixture(autouse=True)
def fixtures_on_path(monkeypatch):
    monkeypatch.syspath_prepend(FIXTURES)
    monkeypatch.setenv("PYTHONPATH", FIXTURES + os.pathsep + os.environ.get("PYTHONPATH", ""))


def log(d):
    return runs.read_log(os.path.join(d, runs.LOG))


def task_record(d):
    return next(r for r in log(d) if r["kind"] == "task")


def stored(d):
    return runs.read_run_config(d)


def cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "espert", *args], capture_output=True, text=True, timeout=600, cwd=cwd or ROOT
    )


def test_docs_example_runs(tmp_path):
    """The example in docs/training.md, as written, with fewer iterations."""
    doc = open(os.path.join(ROOT, "docs", "training.md"), encoding="utf-8").read()
    block = re.search(r"## Your own task or reward.*?```python\n(.*?)```", doc, re.S).group(1)
    assert len([ln for ln in block.splitlines() if ln.strip()]) <= 14
    small = (
        block.replace("iterations=40", "iterations=2")
        .replace("max_new_tokens=2)", "max_new_tokens=2, pretrain_steps=0)")  # a random-init base: ~30 s less
        .replace('"runs/first_letter"', repr(str(tmp_path / "r")))
    )
    assert small != block and "iterations=2" in small
    script = tmp_path / "example.py"
    script.write_text(small)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    held = eval(p.stdout.strip().splitlines()[-1])  # the printed summary["heldout"]
    assert [t for t, _ in held] == [0, 2]
    doc_cfg = stored(str(tmp_path / "r"))
    assert doc_cfg["task"] == doc_cfg["config"]["task"] == "python:first_letter"  # not "copy"
    recs = log(str(tmp_path / "r"))
    assert [r["n"] for r in recs if r["kind"] == "eval"] == [36, 36]  # the 36 held-out prompts, not copy's


def test_reward_fn_from_python_records_its_path_and_scores_heldout_with_it(tmp_path):
    import custom_rewards

    d = str(tmp_path / "run")
    summary = espert.train(
        ESConfig(**SMALL),
        d,
        progress=False,
        echo=None,
        reward=custom_rewards.first_letter,
        prompts=LETTERS[:100],
        eval_prompts=LETTERS[200:],
    )
    assert stored(d)["task"] == "custom_rewards:first_letter"  # the reward's import path, not "copy"
    rec = task_record(d)  # but its problems were a Python list: the run resumes from Python only
    assert rec["kind"] == "task" and rec["source"] == "python" and rec["n_train"] == 100
    # held-out reward = the custom reward of the center on the held-out prompts, recomputed here
    from espert.evaluators.torch_model import TorchEvaluator, load_model

    model, tok = load_model(os.path.join(d, "export"))
    ev = TorchEvaluator(model, tok, lambda c, a: custom_rewards.first_letter(LETTERS[200:204], c, a), max_new_tokens=2)
    want = ev.evaluate_center(LETTERS[200:204], [""] * 4)
    assert summary["heldout"][-1][1] == pytest.approx(sum(want) / 4)


def test_python_task_resume_needs_the_objects_again(tmp_path, capsys):
    import custom_rewards

    d = str(tmp_path / "run")
    kw = dict(progress=False, echo=None, reward=custom_rewards.first_letter, prompts=LETTERS[:50])
    espert.train(ESConfig(**SMALL), d, **kw)
    with pytest.raises(ValueError, match="task given as Python objects.*resume it from Python"):
        espert.train(None, d, resume=True, progress=False, echo=None)
    assert cli_main(["train", "--run-dir", d, "--resume", "--iterations", "3", "--no-progress"]) == 2
    assert "resume it from Python" in capsys.readouterr().err
    with pytest.raises(ValueError, match="fingerprint mismatch"):
        espert.train(ESConfig(**{**SMALL, "iterations": 3}), d, resume=True, **{**kw, "prompts": LETTERS[:49]})
    espert.train(ESConfig(**{**SMALL, "iterations": 3}), d, resume=True, **kw)
    assert [r["iteration"] for r in log(d) if r["kind"] == "iter"] == [1, 2, 3]


def test_task_objects_and_loaders(tmp_path):
    import custom_rewards

    d = str(tmp_path / "task")
    espert.train(ESConfig(**SMALL), d, progress=False, echo=None, task=custom_rewards.B_TASK)
    assert stored(d)["task"] == "python:has_b"
    assert not [r for r in log(d) if r["kind"] == "eval"]  # a Task without held-out problems: no held-out eval
    d = str(tmp_path / "loader")
    espert.train(ESConfig(**SMALL), d, progress=False, echo=None, task=custom_rewards.letters)
    assert stored(d)["task"] == "custom_rewards:letters"  # re-importable: the config alone rebuilds it
    assert task_record(d)["source"] == "import" and task_record(d)["n_eval"] == 4
    espert.train(None, d, resume=True, progress=False, echo=None)  # no object needed


def test_import_path_from_yaml_trains_resumes_and_replays_via_cli(tmp_path, capsys):
    """The failure of the issue: the CLI resume of a custom-reward run (no fake backend anywhere).  The CLI
    runs in this process (its ``main``), except the last call, which needs a process without the module."""
    from espert.cli import main

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": p[0]}) + "\n" for p in LETTERS[:120]))
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in LETTERS[150:160]))
    y = tmp_path / "run.yaml"
    y.write_text(
        f"task: custom_rewards:first_letter\ntrain_data: {data}\neval_data: {held}\niterations: 2\n"
        f"population: 4\nprompts_per_iteration: 4\neval_size: 5\nmax_new_tokens: 2\npretrain_steps: 0\n"
    )
    d = str(tmp_path / "run")
    assert main(["train", "--config", str(y), "--run-dir", d, "--no-progress"]) == 0
    assert stored(d)["task"] == "custom_rewards:first_letter"
    assert [r["n"] for r in log(d) if r["kind"] == "eval"] == [5, 5]
    assert main(["train", "--run-dir", d, "--resume", "--iterations", "3", "--no-progress"]) == 0
    assert [r["iteration"] for r in log(d) if r["kind"] == "iter"] == [1, 2, 3]
    capsys.readouterr()
    assert main(["replay", d, "--out", str(tmp_path / "replay")]) == 0
    err = capsys.readouterr().err
    assert "bit-identical" in err and ": yes" in err, err[-2000:]
    # the module disappears: resume refuses with a clear message, nothing is touched
    before = open(os.path.join(d, runs.LOG), "rb").read()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run(
        [sys.executable, "-m", "espert", "train", "--run-dir", d, "--resume", "--iterations", "4", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    assert p.returncode == 2 and "cannot import task 'custom_rewards:first_letter'" in p.stderr
    assert "Traceback" not in p.stderr
    assert open(os.path.join(d, runs.LOG), "rb").read() == before


def test_bad_task_inputs_are_refused_before_anything_is_written(tmp_path):
    import custom_rewards

    d = str(tmp_path / "run")
    with pytest.raises(ValueError, match="reward function; give its problems"):
        espert.train(ESConfig(**{**SMALL, "task": "custom_rewards:first_letter"}), d, progress=False, echo=None)
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        espert.train(ESConfig(**{**SMALL, "task": "custom_rewards:nope"}), d, progress=False, echo=None)
    with pytest.raises(ValueError, match="reward= needs prompts="):
        espert.train(ESConfig(**SMALL), d, progress=False, echo=None, reward=custom_rewards.first_letter)
    with pytest.raises(ValueError, match="prompt 1: expected a string"):
        espert.train(
            ESConfig(**SMALL), d, progress=False, echo=None, reward=custom_rewards.first_letter, prompts=["a>", 3]
        )
    assert not os.path.exists(d)


def test_object_kinds_by_signature():
    """Three positional arguments: reward(prompts, completions, answers); two: batched reward(completions,
    answers); one: loader(split)."""
    import custom_rewards

    from espert.tasks.loaders import custom_task

    t = custom_task(custom_rewards.first_letter, "train", problems_from=["ab>", "ba>"])
    assert t.score(["a", "a"], t.answers) == [1.0, 0.0]
    t = custom_task(custom_rewards.has_b, "train", problems_from=["ab>", "ba>"])
    assert t.score(["b", "a"], t.answers) == [1.0, 0.0] and t.name == "has_b"
    assert custom_task(custom_rewards.has_b, "test") is None  # no held-out problems given
    t = custom_task(custom_rewards.letters, "test", n=5)
    assert len(t) == 5 and t.prompts[0] == custom_rewards.letters("test").prompts[0]
    with pytest.raises(ValueError, match="returned str for split 'train'"):
        custom_task(lambda split: "oops", "train", name="oops")


def test_prompt_sources(tmp_path):
    from espert.tasks.loaders import problems

    assert problems(["a>", "b>"]) == (["a>", "b>"], ["", ""])
    assert problems([{"prompt": "a>", "answer": "a"}, ("b>", "b")]) == (["a>", "b>"], ["a", "b"])
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a>", "answer": 7}\n\n{"prompt": "b>"}\n')
    assert problems(str(f)) == (["a>", "b>"], ["7", ""])
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"prompt": ["a>", "b>", "c>"], "answer": ["a", "b", "c"]})
    assert problems(ds, n=2) == (["a>", "b>"], ["a", "b"])
    assert torch is not None
