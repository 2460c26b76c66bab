"""No silent minute: pretraining, model loading, GGUF conversion, the closing report, replay and export show
progress on a terminal (ESPERT_PROGRESS=1 stands for one here) and nothing in a log.  The GGUF conversion's
line is checked where a real conversion runs (tests/test_real_model.py).  About 25 s on 2 cores."""

import time

import pytest
from conftest import SMALL_RUN

from espert import progress, train
from espert.config import ESConfig


@pytest.fixture
def terminal(monkeypatch):
    monkeypatch.setenv("ESPERT_PROGRESS", "1")
    monkeypatch.setattr(progress, "TICK", 0.01)  # a step whose size is unknown shows its line at once


def test_progress_follows_stderr_and_the_variable(monkeypatch, capsys):
    monkeypatch.delenv("ESPERT_PROGRESS", raising=False)
    assert not progress.shown()  # captured stderr: a log
    monkeypatch.setenv("ESPERT_PROGRESS", "1")
    assert progress.shown()
    monkeypatch.setattr(progress, "TICK", 0.01)
    with progress.ticking("[espert] waiting"):
        time.sleep(0.1)
    assert "[espert] waiting ... 0 s" in capsys.readouterr().err
    monkeypatch.setenv("ESPERT_PROGRESS", "0")
    with progress.ticking("[espert] waiting"), progress.bar("[espert] counting", 3) as b:
        time.sleep(0.05)
        b.update(3)
    assert capsys.readouterr().err == ""


def test_pretraining_shows_a_bar_on_a_terminal_and_nothing_in_a_log(tmp_path, terminal, capsys, monkeypatch):
    from espert.tiny import build_tiny_model

    build_tiny_model(str(tmp_path / "a"), pretrain_steps=3)
    err = capsys.readouterr().err
    assert (
        "pretraining the tiny model" in err and "/3 [" in err
    )  # its total (the last frame may be skipped: tqdm redraws at most every 0.1 s)
    monkeypatch.setenv("ESPERT_PROGRESS", "0")
    build_tiny_model(str(tmp_path / "b"), pretrain_steps=3)
    assert "pretraining" not in capsys.readouterr().err  # (transformers' own bars: the CLI turns them off)


def test_loading_the_report_replay_and_export_show_progress_on_a_terminal(tmp_path, terminal, capsys):
    from espert.eval.runner import evaluate_run
    from espert.runs import replay

    run = str(tmp_path / "run")
    train(ESConfig(**SMALL_RUN), run, progress=False, echo=None)
    err = capsys.readouterr().err
    assert "[espert] loading the model" in err  # the evaluator's model
    assert "[espert] exporting" in err  # every checkpoint's export
    replay(run, str(tmp_path / "replay"), echo=None)
    err = capsys.readouterr().err
    assert "[espert] replaying the logged updates: " in err and "/6 [" in err and "[espert] exporting" in err
    evaluate_run(run, n=2, limit=4, plots=False, echo=lambda s: None)
    err = capsys.readouterr().err
    assert "[espert] report: sampling base" in err and "[espert] report: sampling es" in err
