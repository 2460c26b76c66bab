"""The training curve as a picture: RUN/eval/training.png (held-out reward, the member reward's mean and
spread per iteration, checkpoints and resumes marked), written by `espert train` and by `espert analyze
run RUN` (or `espert analyze RUN`).  About 20 s on 2 cores."""

import os

import pytest
from conftest import SMALL_RUN

from espert import runs, train
from espert.cli import main
from espert.config import ESConfig

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """A SMALL_RUN stopped after iteration 4 and resumed to its end (6)."""
    d = str(tmp_path_factory.mktemp("curve") / "run")
    train(ESConfig(**SMALL_RUN), d, progress=False, echo=None, stop=lambda: len(_iters(d)) >= 4)
    train(None, d, resume=True, progress=False, echo=None)
    return d


def _iters(d):
    log = os.path.join(d, runs.LOG)
    return [r for r in runs.read_log(log) if r.get("kind") == "iter"] if os.path.exists(log) else []


def test_the_curve_holds_heldout_member_rewards_checkpoints_and_resumes(resumed):
    from espert.eval.curve import training_curve

    c = training_curve(resumed)
    assert c["iterations"] == [1, 2, 3, 4, 5, 6]
    assert [t for t, _ in c["heldout"]] == [0, 3, 6]
    assert len(c["reward_mean"]) == len(c["reward_std"]) == 6
    assert all(lo <= m <= hi for lo, m, hi in zip(c["reward_min"], c["reward_mean"], c["reward_max"]))
    assert c["checkpoints"] == [2, 4, 6] and c["resumes"] == [4]
    assert c["task"] == "copy" and c["population"] == SMALL_RUN["population"]


def test_analyze_run_and_its_short_form_write_training_png(resumed, capsys):
    png = os.path.join(resumed, "eval", "training.png")
    assert main(["analyze", resumed]) == 0  # was: "invalid choice" (exit 2)
    out = capsys.readouterr().out
    assert f"wrote {png}" in out and "iterations" in out
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    os.remove(png)
    assert main(["analyze", "run", resumed]) == 0 and os.path.exists(png)
    assert main(["analyze", str(resumed) + "-missing"]) == 2
    assert "no run log" in capsys.readouterr().err


def test_analyze_usage_shows_every_form_and_no_required_subcommand(capsys):
    with pytest.raises(SystemExit):
        main(["analyze", "--help"])
    usage = capsys.readouterr().out.split("\n\n")[0]
    assert "RUN_DIR" in usage and "--base" in usage and "SUBCOMMAND ..." not in usage


def test_train_writes_the_training_curve_at_its_end(tmp_path, capsys):
    d = str(tmp_path / "run")
    cfg = {**SMALL_RUN, "iterations": 2, "eval_every": 1}
    args = [f"--{k.replace('_', '-')}={v}" for k, v in cfg.items()]
    assert main(["train", "--run-dir", d, "--no-report", "--no-progress", *args]) == 0
    assert os.path.exists(os.path.join(d, "eval", "training.png"))
    assert f"[espert] training curve: {os.path.join(d, 'eval', 'training.png')}" in capsys.readouterr().err
