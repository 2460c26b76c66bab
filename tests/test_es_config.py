"""ESConfig is described once (espert/config.py); the CLI, the docs table and the old spellings follow from it."""

import dataclasses
import os
import re
import subprocess
import sys
import typing

import pytest

from espert import config as C
from espert.cli import build_parser, config_from_args, main
from espert.config import ESConfig
from espert.runs import legacy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_docs_table_is_the_generated_one():
    with open(os.path.join(ROOT, "docs", "training.md"), encoding="utf-8") as f:
        doc = f.read()
    m = re.search(r"<!-- config-table:start -->\n(.*?)<!-- config-table:end -->", doc, re.S)
    assert m, "docs/training.md lost its config-table markers"
    assert m.group(1) == C.config_table(), "docs/training.md's config table is stale: run `python -m espert.config`"
    # every field has a row, with its help text
    for f in dataclasses.fields(ESConfig):
        assert f"| `{f.name}` |" in m.group(1)


def test_cli_help_and_choices_come_from_the_fields():
    p = build_parser()
    train = next(a for a in p._subparsers._group_actions[0].choices.values() if a.prog.endswith("train"))
    by_dest = {a.dest: a for a in train._actions if not isinstance(a, C.Renamed)}  # old names share the dest
    helps, choices = C.field_help(), C.field_choices()
    for f in dataclasses.fields(ESConfig):
        a = by_dest[f.name]
        assert a.help.replace("%%", "%").startswith(helps[f.name]), f.name
        if f.name in choices:
            assert tuple(a.choices) == choices[f.name]
    assert choices["normalization"] == C.NORMALIZATIONS == ("zscore", "rank", "rank_unit")
    assert choices["sigma_schedule"] == C.SCHEDULES
    from espert import es

    assert es.NORMALIZATIONS is C.NORMALIZATIONS and es.SCHEDULES is C.SCHEDULES


def test_quant_choices_match_the_formats():
    from espert.quant.formats import FORMATS

    assert C.field_choices()["quant"] == ("none", *FORMATS)


def test_config_module_imports_no_torch_or_numpy():
    code = (
        "import sys, espert.config, espert\nespert.ESConfig\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'espert')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['espert', 'espert.config']"


def test_literal_fields_are_validated_with_a_clear_message():
    with pytest.raises(ValueError, match=r"normalization must be one of \('zscore', 'rank', 'rank_unit'\)"):
        ESConfig(normalization="minmax")
    with pytest.raises(ValueError, match="noise must be gaussian, gaussian-icdf, rademacher or lowrank:R"):
        ESConfig(noise="lowrank:0")
    for ok in ("gaussian", "rademacher", "lowrank:4"):
        assert ESConfig(noise=ok).noise == ok
    with pytest.raises(ValueError, match="optimizer_beta1 must be in"):
        ESConfig(optimizer="momentum", optimizer_beta1=1.0)
    with pytest.raises(ValueError, match="unknown tracker"):
        ESConfig(trackers=["mlflow"])
    with pytest.raises(ValueError, match="import path"):
        ESConfig(task="mypkg.rewards:")


def test_noise_syntax_agrees_with_the_noise_layer():
    from espert.noise import MAX_RANK, NoiseFamily

    assert C.NOISE_MAX_RANK == MAX_RANK
    for spec in (
        "gaussian",
        "rademacher",
        "lowrank:1",
        "lowrank:64",
        f"lowrank:{MAX_RANK}",
        f"lowrank:{MAX_RANK + 1}",
        "lowrank:0",
        "lowrank:",
        "lowrank",
        "gaussian:2",
        "uniform",
        "lowrank:x",
        " gaussian",
    ):
        try:
            NoiseFamily.parse(spec)
            ok = spec == spec.strip()  # the config takes no surrounding spaces
        except ValueError:
            ok = False
        try:
            ESConfig(noise=spec)
            mine = True
        except ValueError:
            mine = False
        assert mine == ok, spec


def test_backend_is_now_evaluator_with_a_deprecation_message(capsys, tmp_path):
    cfg = ESConfig.from_dict({"backend": "vllm"})
    assert cfg.evaluator == "vllm"
    assert "config key 'backend' is deprecated; it is now called 'evaluator'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="both 'backend' and its new name 'evaluator'"):
        ESConfig.from_dict({"backend": "vllm", "evaluator": "torch"})
    args = build_parser().parse_args(["train", "--backend", "vllm"])
    assert config_from_args(args)[0].evaluator == "vllm"
    assert "--backend is deprecated; use --evaluator" in capsys.readouterr().err
    y = tmp_path / "old.yaml"
    y.write_text("backend: vllm\n")
    assert config_from_args(build_parser().parse_args(["train", "--config", str(y)]))[0].evaluator == "vllm"


def v1_config(**kw) -> dict:
    """A config dict exactly as version-1 run directories stored it (every v1 field, 'backend')."""
    d = ESConfig(**kw).to_dict()
    d["backend"] = d.pop("evaluator")
    return {k: v for k, v in d.items() if k in legacy.V1_FIELDS}


def test_v1_run_configs_keep_their_old_behaviour(capsys):
    old = ESConfig.from_dict(legacy.upgrade_config(v1_config(weight_decay=0.1)))  # as read_run_config reads it
    assert (old.prompt_sampler, old.weight_decay_exclude, old.reward_std_floor) == ("python_random", [], 0.0)
    new = ESConfig.from_dict({"weight_decay": 0.1})  # a user's partial config gets today's defaults
    assert (new.prompt_sampler, new.weight_decay_exclude, new.reward_std_floor) == (
        "sha256",
        list(C.NO_DECAY_DEFAULT),
        1e-6,
    )
    assert legacy.V1_FIELDS - {"backend"} <= {f.name for f in dataclasses.fields(ESConfig)}


def test_new_fields_round_trip_through_yaml_and_flags(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text(
        "optimizer: adam\noptimizer_beta2: 0.99\nsigma_mode: rms\nnoise: lowrank:2\n"
        "weight_decay_exclude: ['*norm*']\ntrackers: [tensorboard]\n"
    )
    cfg = config_from_args(
        build_parser().parse_args(
            ["train", "--config", str(y), "--weight-decay-exclude", "--normalization", "rank_unit"]
        )
    )[0]
    assert (cfg.optimizer, cfg.optimizer_beta2, cfg.sigma_mode, cfg.noise) == ("adam", 0.99, "rms", "lowrank:2")
    assert cfg.weight_decay_exclude == [] and cfg.trackers == ["tensorboard"] and cfg.normalization == "rank_unit"
    assert ESConfig.from_dict(cfg.to_dict()) == cfg


def test_bad_values_are_one_line_errors_in_the_cli(capsys):
    assert main(["train", "--noise", "uniform"]) == 2
    err = capsys.readouterr().err
    assert "noise must be" in err and "Traceback" not in err
    assert main(["train", "--task", "no.such.module:reward", "--run-dir", "/nonexistent/x"]) == 2
    err = capsys.readouterr().err
    assert "cannot import task 'no.such.module:reward'" in err and "Traceback" not in err


def test_type_hints_cover_every_field():
    hints = typing.get_type_hints(ESConfig)
    for f in dataclasses.fields(ESConfig):
        assert f.name in hints and f.metadata.get("help"), f.name


def test_docs_main_job_paragraph_states_the_defaults():
    """docs/training.md said 150 iterations, evaluated every 25, when the main job ran 80 and 20 (issue 43)."""
    import re

    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "training.md"), encoding="utf-8").read()
    para = re.sub(r"\s+", " ", text.split("## The main job", 1)[1].split("Sample output", 1)[0])
    cfg = ESConfig()
    m = re.search(r"(\d+) iterations of (\d+) members \((\d+) antithetic seeds\) × (\d+) prompts", para)
    assert m, para
    assert tuple(map(int, m.groups())) == (
        cfg.iterations,
        cfg.population,
        cfg.population // 2,
        cfg.prompts_per_iteration,
    )
    m = re.search(r"scoring (\d+) held-out prompts at the center every (\d+) iterations", para)
    assert m and tuple(map(int, m.groups())) == (cfg.eval_size, cfg.eval_every), para
    assert f"{cfg.pretrain_steps} steps of next-character prediction" in para
