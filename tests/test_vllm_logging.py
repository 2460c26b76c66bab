"""vLLM's own INFO logging is off by default (it flooded the progress bar: one "Successfully reset prefix
cache" line per weight change, 166 in 10 iterations); ``--verbose`` gives it back."""

import logging
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_through_vllm_keeps_vllm_quiet(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("VLLM_LOGGING_LEVEL", None)
    args = [sys.executable, "-m", "espert", "train", "--evaluator", "vllm", "--pretrain-steps", "0"]
    args += ["--iterations", "2", "--population", "2", "--prompts-per-iteration", "4", "--max-new-tokens", "4"]
    args += ["--eval-size", "4", "--vllm-max-model-len", "64", "--run-dir", str(tmp_path / "run"), "--no-progress"]
    p = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout + p.stderr
    assert "reset prefix cache" not in out and " INFO " not in out, out[-3000:]
    assert "[espert] held-out mean reward" in out


def test_verbose_restores_vllm_logging(monkeypatch):
    from espert.cli import build_parser
    from espert.vllm import quiet_logging

    assert build_parser().parse_args(["train", "--verbose"]).verbose
    assert build_parser().parse_args(["eval", "--verbose"]).verbose
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    quiet_logging(verbose=False)
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING" and logging.getLogger("vllm").level == logging.WARNING
    quiet_logging(verbose=True)
    assert os.environ["VLLM_LOGGING_LEVEL"] == "INFO" and logging.getLogger("vllm").level == logging.INFO
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # the user's own setting wins
    quiet_logging(verbose=False)
    assert logging.getLogger("vllm").level == logging.DEBUG
