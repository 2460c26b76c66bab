"""The short forms a newcomer types after the main job, with the defaults that make them work:
``espert train`` points ``runs/latest`` at its run; ``espert eval --models base=RUN/base_model
es=RUN/export`` takes the task (and its generation budget) from the run; ``espert sweep`` writes to
``sweeps/<grid>`` and takes train's flags; ``ESPERT_SMOKE=1`` puts every command on a smoke-test budget
(how CI runs the documented commands as printed).  About 60 s on 2 cores."""

import json
import os

import pytest

from espert.cli import main

SMALL = ["--pretrain-steps", "0", "--population", "4", "--prompts-per-iteration", "4", "--eval-size", "4"]


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory):
    """A working directory where `espert train` (no --run-dir) ran: runs/es-STAMP and runs/latest."""
    cwd = tmp_path_factory.mktemp("newcomer")
    mp = pytest.MonkeyPatch()
    mp.chdir(cwd)
    assert main(["train", "--iterations", "2", "--no-report", "--no-progress", *SMALL]) == 0
    yield cwd
    mp.undo()


def test_train_points_runs_latest_at_its_run(newcomer):
    latest = newcomer / "runs" / "latest"
    assert latest.is_symlink() and os.readlink(latest).startswith("es-")  # relative: the folder can move
    assert (latest / "export" / "model.safetensors").exists()
    assert main(["replay", "runs/latest", "--out", str(newcomer / "replayed")]) == 0


def test_eval_takes_the_task_from_the_run(newcomer, capsys, monkeypatch):
    monkeypatch.chdir(newcomer)
    args = ["eval", "--models", "base=runs/latest/base_model", "es=runs/latest/export", "-n", "2", "--limit", "3"]
    assert main([*args, "--no-plots", "--out", "ev"]) == 0  # was: "--task is required when generating"
    err = capsys.readouterr().err
    assert "[espert eval] task copy, 8 new tokens: from runs/latest/config.yaml" in err, err
    report = json.loads((newcomer / "ev" / "report.json").read_text())
    assert report["task"] == "copy" and set(report["models"]) == {"base", "es"}
    rec = json.loads((newcomer / "ev" / "samples_es.jsonl").read_text().splitlines()[0])
    assert rec["meta"]["max_tokens"] == 8
    # a model outside any run still needs --task, and says so in one line
    assert main(["eval", "--models", f"m={newcomer / 'replayed' / 'export'}", "--out", "ev2"]) == 2
    assert "--task is required" in capsys.readouterr().err and not (newcomer / "ev2").exists()


def test_sweep_writes_under_sweeps_and_takes_train_flags(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["sweep", "--grid", "sigma=0.01,0.03", "--iterations", "1", "--eval-every", "0", *SMALL]
    assert main(args) == 0  # was: --out required, --iterations unrecognized
    out = tmp_path / "sweeps" / "sigma=0.01,0.03"
    doc = json.loads((out / "sweep.json").read_text())
    assert set(doc["runs"]) == {"sigma=0.01", "sigma=0.03"} and doc["set"]["iterations"] == "1"
    assert all(r["status"] == "done" and r["iterations"] == 1 for r in doc["runs"].values())
    capsys.readouterr()
    assert main([*args, "--alpha", "0.5"]) == 2  # other settings into the same folder: refused (more iterations
    # would extend the runs, as resume does)
    err = capsys.readouterr().err
    assert "holds a sweep with other settings" in err and "--out" in err
    assert main(["sweep", "--grid", "sigma=0.01", "--set", "iterations=1", "--iterations", "2"]) == 2
    assert "iterations is given twice" in capsys.readouterr().err


def test_smoke_budget_caps_every_command_and_says_so(tmp_path, capsys, monkeypatch):
    from espert import runs

    monkeypatch.setenv("ESPERT_SMOKE", "1")
    d = str(tmp_path / "run")
    assert main(["train", "--run-dir", d, "--no-report", "--no-progress", "--pretrain-steps", "0"]) == 0
    err = capsys.readouterr().err
    assert "[espert] ESPERT_SMOKE=1: smoke-test budget: iterations 80 -> 2" in err, err
    cfg = runs.read_run_config(d)["config"]
    assert cfg["iterations"] == 2 and cfg["population"] <= 4 and cfg["eval_size"] <= 8
