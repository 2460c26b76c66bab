"""End-to-end tests of ``python -m espert eval`` on a tiny, locally built random model."""

import argparse
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))
from tiny_model import build_tiny_model  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return build_tiny_model(str(root / "base"), seed=0), build_tiny_model(str(root / "other"), seed=1)


def run_cli(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "espert", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_eval_end_to_end_and_rescore(tiny_models, tmp_path):
    base, other = tiny_models
    out = tmp_path / "out"
    res = run_cli(
        "eval",
        "--task",
        "copy",
        "--split",
        "test",
        "--limit",
        "6",
        "--models",
        f"base={base}",
        f"tuned={other}",
        "--base",
        "base",
        "-n",
        "4",
        "--max-new-tokens",
        "6",
        "--seed",
        "3",
        "--batch-size",
        "8",
        "--out",
        str(out),
    )
    assert res.returncode == 0, res.stderr
    assert "task copy: 6 problems, n=4" in res.stdout and "tuned vs base" in res.stdout
    for label in ("base", "tuned"):
        lines = (out / f"samples_{label}.jsonl").read_text().splitlines()
        assert len(lines) == 6
        rec = json.loads(lines[0])
        assert rec["model"] == label and rec["task"] == "copy" and rec["index"] == 0
        assert rec["prompt"].endswith(">") and len(rec["completions"]) == 4
        assert len(rec["rewards"]) == 4 and len(rec["extracted"]) == 4
        assert all(0.0 <= r <= 1.0 for r in rec["rewards"])
        assert rec["meta"]["seed"] == 3 and rec["meta"]["temperature"] == 0.6
    report = json.loads((out / "report.json").read_text())
    assert set(report["models"]) == {"base", "tuned"} and report["base"] == "base"
    assert list(report["models"]["base"]["pass_at_k"]) == ["1", "2", "4"]
    assert sum(report["models"]["tuned"]["accuracy_histogram"]["counts"]) == 6
    assert "tuned" in report["comparisons"]
    for png in ("pass_at_k.png", "accuracy_hist.png", "progressions.png"):
        data = (out / png).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000
    assert (out / "summary.txt").read_text().strip() == res.stdout.strip()

    # re-scoring the saved samples (no model, no generation) reproduces the report exactly
    out2 = tmp_path / "rescored"
    res2 = run_cli(
        "eval",
        "--samples",
        str(out / "samples_base.jsonl"),
        str(out / "samples_tuned.jsonl"),
        "--base",
        "base",
        "--out",
        str(out2),
        "--no-plots",
    )
    assert res2.returncode == 0, res2.stderr
    assert json.loads((out2 / "report.json").read_text()) == report
    assert res2.stdout == res.stdout


def test_sampler_seeded_and_greedy(tiny_models):
    from espert.eval.samplers import TransformersSampler

    s = TransformersSampler(tiny_models[0], device="cpu", batch_size=4)
    prompts = ["abcd>", "fed>", "cafe>"]
    a = s.sample(prompts, 3, temperature=1.0, top_p=0.95, max_tokens=5, seed=7)
    b = s.sample(prompts, 3, temperature=1.0, top_p=0.95, max_tokens=5, seed=7)
    c = s.sample(prompts, 3, temperature=1.0, top_p=0.95, max_tokens=5, seed=8)
    assert a == b and a != c
    assert len(a) == 3 and all(len(x) == 3 for x in a)
    g = s.sample(prompts[:1], 3, temperature=0.0, top_p=1.0, max_tokens=5, seed=0)
    assert g[0][0] == g[0][1] == g[0][2]
    with pytest.raises(ValueError):
        s.sample(prompts, 0, 1.0, 0.9, 5, 0)
    with pytest.raises(TypeError):
        s.sample("abcd>", 1, 1.0, 0.9, 5, 0)


def test_vllm_sampler_clear_error_without_vllm():
    try:
        import vllm  # noqa: F401

        pytest.skip("vllm is installed")
    except ImportError:
        pass
    from espert.eval.samplers import VLLMSampler

    with pytest.raises(ImportError, match="pip install vllm"):
        VLLMSampler("some/model")


def test_cli_errors_are_clear(tmp_path, capsys):
    from espert.cli import main

    assert (
        main(["eval", "--task", "copy", "--models", f"m={tmp_path / 'missing_model'}", "--out", str(tmp_path / "o")])
        == 2
    )
    assert "missing_model" in capsys.readouterr().err
    assert main(["eval", "--task", "copy"]) == 2
    assert "exactly one of --models" in capsys.readouterr().err
    assert main(["eval", "--samples", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl" in capsys.readouterr().err
    assert main(["eval", "--task", "bogus", "--models", "m=x"]) == 2
    assert "known tasks" in capsys.readouterr().err


def test_parser_functions_attach_to_any_subparsers():
    from espert.eval.cli import add_analyze_parser, add_eval_parser, run_eval

    parser = argparse.ArgumentParser(prog="espert")
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_eval_parser(sub)
    add_analyze_parser(sub)
    args = parser.parse_args(["eval", "--samples", "a.jsonl", "b.jsonl", "--base", "a"])
    assert args.func is run_eval and args.samples == ["a.jsonl", "b.jsonl"]
    assert args.n == 8 and args.temperature == 0.6 and args.top_p == 0.95
    args = parser.parse_args(["analyze", "--base", "b", "--ckpt", "c", "--export", "o", "--threshold", "1e-4"])
    assert callable(args.func) and args.threshold == 1e-4


def test_evaluate_run_reports_base_against_the_final_export(tmp_path):
    from espert.config import ESConfig
    from espert.eval.runner import evaluate_run
    from espert.trainer import train

    d = str(tmp_path / "run")
    train(
        ESConfig(
            iterations=1, population=2, prompts_per_iteration=2, eval_size=2, checkpoint_every=0, pretrain_steps=0
        ),
        d,
        progress=False,
        echo=None,
    )
    lines = []
    rep = evaluate_run(d, n=4, limit=3, echo=lines.append)
    assert list(rep["models"]) == ["base", "es"] and rep["models"]["es"]["n_problems"] == 3
    assert set(rep["models"]["base"]["pass_at_k"]) == {"1", "2", "4"}
    assert "es vs base" in lines[0]
    for f in ("report.json", "summary.txt", "pass_at_k.png", "samples_base.jsonl", "samples_es.jsonl"):
        assert os.path.getsize(os.path.join(d, "eval", f)) > 0
    with pytest.raises(FileNotFoundError, match="not an espert run"):
        evaluate_run(str(tmp_path))


def test_main_job_cli_closes_with_the_base_vs_es_report(tmp_path, capsys):
    from espert.cli import main

    d = str(tmp_path / "run")
    assert (
        main(
            [
                "train",
                "--iterations",
                "1",
                "--population",
                "2",
                "--prompts-per-iteration",
                "2",
                "--eval-size",
                "2",
                "--checkpoint-every",
                "0",
                "--pretrain-steps",  # a random-init base: the report, not pretraining, is checked here
                "0",
                "--run-dir",
                d,
                "--no-progress",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "base vs ES" in err and "pass@16" in err and "es vs base" in err
    rep = json.load(open(os.path.join(d, "eval", "report.json")))
    assert list(rep["models"]) == ["base", "es"] and rep["models"]["es"]["n_problems"] == 64
    assert os.path.getsize(os.path.join(d, "eval", "pass_at_k.png")) > 0


def test_eval_takes_the_tasks_train_takes(tiny_models, tmp_path, monkeypatch):
    """espert eval resolves --task like espert train (espert.tasks.load_spec_task): an import path to a
    loader, and a reward function with its problems from --data (before: "unknown task 'mymod:load'")."""
    from espert.cli import main

    base, _ = tiny_models
    (tmp_path / "mytask.py").write_text(
        "from espert.tasks import load_task\n"
        "def load(split):\n"
        "    return load_task('copy', split, n=3)\n"
        "def reward(prompts, completions, answers):\n"
        "    return [float(c.startswith('a')) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"copy: ab{i}\n", "answer": f"ab{i}"}) + "\n" for i in range(4)))
    common = ["-n", "2", "--max-tokens", "4", "--batch-size", "8", "--no-plots"]
    out = tmp_path / "o1"
    assert (
        main(["eval", "--task", "mytask:load", "--split", "train", "--models", f"m={base}", "--out", str(out)] + common)
        == 0
    )
    assert sum(1 for _ in open(out / "samples_m.jsonl")) == 3
    out = tmp_path / "o2"
    args = ["eval", "--task", "mytask:reward", "--data", str(data), "--models", f"m={base}", "--out", str(out)]
    assert main(args + common) == 0
    recs = [json.loads(line) for line in open(out / "samples_m.jsonl")]
    assert len(recs) == 4 and recs[0]["prompt"] == "copy: ab0\n"


def test_eval_shows_sampling_progress(tiny_models, tmp_path, capsys, monkeypatch):
    """espert eval printed nothing while sampling (minutes on a real model): on a terminal (ESPERT_PROGRESS=1
    stands for one) a bar counts the problems; a log gets none (espert/progress.py)."""
    from espert.cli import main

    base, _ = tiny_models
    args = ["eval", "--task", "copy", "--limit", "5", "--models", f"m={base}", "-n", "2", "--max-tokens", "3"]
    monkeypatch.setenv("ESPERT_PROGRESS", "1")
    assert main(args + ["--batch-size", "4", "--no-plots", "--out", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    assert "[espert eval] sampling m: " in err and "/5 [" in err, err
    monkeypatch.setenv("ESPERT_PROGRESS", "0")
    assert main(args + ["--batch-size", "4", "--no-plots", "--out", str(tmp_path / "p")]) == 0
    assert "[espert eval] sampling m: " not in capsys.readouterr().err


def test_a_run_without_held_out_problems_has_no_closing_report(tmp_path, capsys):
    """Found by CI's install check: a tiny-model run with --eval-size 0 on a Hub task (math500 with local
    training data) trained, then its closing report asked the Hub for held-out problems and failed."""
    from espert.cli import main

    d = str(tmp_path / "run")
    argv = ["train", "--iterations", "1", "--population", "2", "--prompts-per-iteration", "2", "--eval-size", "0"]
    assert main([*argv, "--pretrain-steps", "0", "--run-dir", d, "--no-progress"]) == 0
    assert "base vs ES" not in capsys.readouterr().err and not os.path.exists(os.path.join(d, "eval", "report.json"))
