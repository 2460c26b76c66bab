"""The espert command line: help, config files and flags, refusals with clear messages."""

import os
import subprocess
import sys

import pytest

from espert import runs
from espert.cli import build_parser, config_from_args, main
from espert.config import ESConfig

TINY_FLAGS = [
    "--pretrain-steps",  # random-init tiny base (pretraining costs ~30 s and is not what these tests check)
    "0",
    "--iterations",
    "2",
    "--population",
    "2",
    "--prompts-per-iteration",
    "3",
    "--train-size",
    "16",
    "--eval-size",
    "3",
    "--max-new-tokens",
    "3",
    "--no-progress",
]


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("train", "replay", "tiny", "eval", "analyze"):
        assert cmd in out
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for flag in (
        "--population",
        "--sigma",
        "--antithetic",
        "--no-antithetic",
        "--resume",
        "--config",
        "--include",
        "Qwen/Qwen2.5-1.5B-Instruct",
    ):
        assert flag in out
    assert main([]) == 2  # no command: help, usage error


def test_python_m_espert():
    p = subprocess.run([sys.executable, "-m", "espert", "--help"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "train" in p.stdout


def parse(argv):
    return config_from_args(build_parser().parse_args(argv))[0]


def test_precedence_defaults_file_flags(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("sigma: 0.01\npopulation: 8\nexclude: [embed_tokens]\nantithetic: false\n")
    cfg = parse(["train", "--config", str(y), "--population", "6"])
    assert (cfg.sigma, cfg.population, cfg.exclude, cfg.antithetic) == (0.01, 6, ["embed_tokens"], False)
    assert cfg.alpha == ESConfig().alpha  # default
    t = tmp_path / "c.toml"
    t.write_text('sigma = 0.02\ninclude = ["mlp", "self_attn"]\nsigma_schedule = "linear"\nsigma_end = 0.01\n')
    cfg = parse(["train", "--config", str(t), "--antithetic"])
    assert (cfg.sigma, cfg.include, cfg.sigma_schedule, cfg.antithetic) == (0.02, ["mlp", "self_attn"], "linear", True)


def test_shipped_configs_parse():
    cdir = os.path.join(os.path.dirname(__file__), "..", "configs")
    files = [f for f in os.listdir(cdir) if f.endswith((".yaml", ".toml"))]
    assert files
    for f in files:
        parse(["train", "--config", os.path.join(cdir, f)])


def test_bad_inputs_give_clear_errors(tmp_path, capsys):
    y = tmp_path / "bad.yaml"
    y.write_text("sigma: 0.01\nlearning_rate: 3\n")
    assert main(["train", "--config", str(y), "--run-dir", str(tmp_path / "r")]) == 2
    assert "unknown config key(s): 'learning_rate' (see espert train --help)" in capsys.readouterr().err
    assert main(["train", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err
    assert main(["train", "--population", "3"]) == 2
    assert "even population" in capsys.readouterr().err
    assert main(["replay", str(tmp_path / "nothing")]) == 2
    assert "run directory not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--sigma", "abc"])


def test_train_resume_replay_cli(tmp_path, capsys):
    d = str(tmp_path / "run")
    assert main(["train", "--run-dir", d, *TINY_FLAGS]) == 0
    err = capsys.readouterr().err
    assert "held-out mean reward: it 0:" in err and "final weights (HF format)" in err
    assert os.path.isdir(os.path.join(d, runs.EXPORT))
    # existing run directory without --resume
    assert main(["train", "--run-dir", d, *TINY_FLAGS]) == 2
    assert "already holds an espert run" in capsys.readouterr().err
    # resume with a changed setting
    assert main(["train", "--run-dir", d, "--resume", "--sigma", "0.5", "--no-progress"]) == 2
    assert "config mismatch on resume" in capsys.readouterr().err
    # extend the run by two iterations
    assert main(["train", "--run-dir", d, "--resume", "--iterations", "4", "--no-progress"]) == 0
    assert runs.read_run_config(d)["config"]["iterations"] == 4
    assert main(["replay", d]) == 0
    assert "bit-identical" in capsys.readouterr().err


def test_tiny_command(tmp_path, capsys):
    assert main(["tiny", str(tmp_path / "m"), "--seed", "2"]) == 0
    assert os.path.exists(tmp_path / "m" / "model.safetensors")


def test_resume_without_run_dir_is_a_usage_error(capsys):
    """Today: exit 1 and no "error:", unlike every other usage error (exit 2)."""
    assert main(["train", "--resume"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "espert train: error: --resume needs --run-dir (the run to continue)"
    )
