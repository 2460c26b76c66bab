"""ES vs GRPO end to end (espert.experiments.compare), the fast variant: same base, task, reward and rollout budget."""

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("trl", reason="the ES-vs-GRPO comparison needs TRL (pip install 'espert[compare]')")

from espert.cli import main  # noqa: E402
from espert.experiments.compare import CompareConfig  # noqa: E402


def test_compare_fast_variant_end_to_end(tmp_path):
    out = str(tmp_path / "cmp")
    # as a user runs it: its own process, so that what TRL prints at import shows too
    res = subprocess.run(
        [sys.executable, "-m", "espert", "compare", "--out", out, "--fast", "--schedule", "es,grpo"],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    said = res.stdout + res.stderr  # quiet: no TRL version warnings, no raw log dicts, the table once
    assert "TRL currently supports vLLM" not in said and "{'loss'" not in said and "'train_runtime'" not in said
    assert said.count(" samples/problem, ") == 1, said[-4000:]
    doc = json.load(open(os.path.join(out, "compare.json")))
    cc = CompareConfig.fast()
    es, grpo = doc["budgets"]["ES"], doc["budgets"]["GRPO"]
    # the same rollout budget, counted the same way for both methods
    assert (
        es["rollouts"]
        == grpo["rollouts"]
        == cc.es_rollouts()
        == cc.grpo_steps() * cc.num_generations * cc.prompts_per_step
    )
    for b in (es, grpo):
        assert 0 < b["generated_tokens"] <= b["rollouts"] * cc.max_new_tokens
        assert b["rollout_forward_flops"] == 2.0 * doc["n_params"] * (b["prompt_tokens"] + b["generated_tokens"])
    # the composition: ES for half the budget, then GRPO from its model for the other half; both
    # phases' models are evaluated, and its rollouts are those of ES alone
    comp = doc["budgets"]["es-grpo"]
    assert doc["schedules"]["es-grpo"] == [["es", 0.5], ["grpo", 0.5]]
    assert comp["rollouts"] == es["rollouts"] == 3 * 8 * 8 + 3 * 8 * 8  # 3 ES iterations, 3 GRPO steps
    assert set(doc["eval"]) == {"base", "es", "grpo", "es-grpo.1", "es-grpo"}
    assert doc["drift"]["es-grpo"]["overall"]["rel_l2"] > 0
    assert set(doc["pareto"]["points"]) == set(doc["eval"]) and doc["pareto"]["front"]
    assert set(doc["token_entropy"]) == set(doc["eval"]) and all(h > 0 for h in doc["token_entropy"].values())
    # token entropy on the probe set during training, at equal steps of each budget (step 0: the
    # base); the last probe is the saved model's entropy, so the probe saw the trained weights
    cc_steps = {"ES": [0, 1, 2, 4, 5, 6], "GRPO": [0, 1, 2, 4, 5, 6]}
    for method, label in (("ES", "es"), ("GRPO", "grpo")):
        probes = doc["probe_entropy"][method]
        assert [s for s, _ in probes] == cc_steps[method]
        assert probes[0][1] == pytest.approx(doc["token_entropy"]["base"], abs=1e-9)
        assert probes[-1][1] == pytest.approx(doc["token_entropy"][label], abs=1e-9)
    assert len({h for _, h in doc["probe_entropy"]["GRPO"]}) > 1  # the policy's entropy moved
    assert {phase for phase, _, _ in doc["probe_entropy"]["es-grpo"]} == {1, 2}
    # GRPO's own token entropy during training (TRL's log), in bits, and per phase in the composition
    assert doc["grpo_train_entropy"]["GRPO"] and all(h >= 0 for _, h in doc["grpo_train_entropy"]["GRPO"])
    assert {phase for phase, _, _ in doc["grpo_train_entropy"]["es-grpo"]} == {2}
    for m in doc["eval"].values():
        assert m["n_samples_per_problem"] == cc.n and m["n_problems"] == cc.eval_size
        assert set(m["pass_at_k"]) == set(m["maj_at_k"]) == {"1", "2", "4", "8"}
        assert sum(m["accuracy_histogram"]["counts"]) == cc.eval_size
    assert set(doc["comparisons"]) == {"es", "grpo", "es-grpo.1", "es-grpo"}
    # both fine-tuned models moved away from the base, and the analysis says by how much
    assert doc["drift"]["es"]["overall"]["rel_l2"] > 0 and doc["drift"]["grpo"]["overall"]["rel_l2"] > 0
    for f in (
        "report.md",
        "eval/pass_at_k.png",
        "eval/accuracy_hist.png",
        "eval/progressions.png",
        "eval/drift_groups.png",
        "eval/pareto.png",
        "eval/probe_entropy.png",
        "es-grpo/2-grpo/model.safetensors",
        "es/model.safetensors",
        "grpo/model.safetensors",
    ):
        assert os.path.getsize(os.path.join(out, f)) > 0, f
    text = open(os.path.join(out, "report.md")).read()
    assert "| ES | " in text and "| GRPO | " in text and "progressions" in text and "## Token entropy" in text


def test_schedules_parse_into_phases_that_share_the_budget(capsys):
    from espert.experiments.compare.config import parse_schedule, phase_budget, schedule_label

    assert parse_schedule("es,grpo") == [("es", 0.5), ("grpo", 0.5)]
    assert parse_schedule("grpo:0.25, es") == [("grpo", 0.25), ("es", 0.75)]
    assert schedule_label("grpo:0.25,es") == "grpo-es"
    cc = CompareConfig.fast()
    es, grpo = phase_budget(cc, "es", 0.5), phase_budget(cc, "grpo", 0.5)
    assert (cc.iterations, cc.grpo_steps(), es, grpo) == (6, 6, 3, 3)
    for bad, why in (
        ("es", "two or more phases"),
        ("es,sft", "unknown phase 'sft'"),
        ("es:0.8,grpo:0.4", "more than the whole budget"),
        ("es:1,grpo", "leave nothing"),
        ("es:x,grpo", "not a number"),
    ):
        with pytest.raises(ValueError, match=why):
            parse_schedule(bad)
    assert main(["compare", "--fast", "--schedule", "es,sft"]) == 2
    assert capsys.readouterr().err.strip().endswith("unknown phase 'sft'; phases are es, grpo")


def test_entropy_curves_put_every_method_on_the_same_budget_axis():
    from espert.experiments.compare.arms import probe_steps
    from espert.experiments.compare.report import entropy_curves

    assert probe_steps(6, 5) == [0, 1, 2, 4, 5, 6] and probe_steps(1, 5) == [0, 1] and probe_steps(4, 0) == []
    probes = {
        "ES": [(0, 1.0), (3, 0.5), (6, 0.25)],
        "es-grpo": [(1, 0, 1.0), (1, 3, 0.9), (2, 0, 0.9), (2, 2, 0.4), (2, 8, 0.2)],
        "GRPO": [],
    }
    curves = entropy_curves(probes, {"es-grpo": [("es", 0.25), ("grpo", 0.75)]})
    assert curves["ES"] == [(0.0, 1.0), (0.5, 0.5), (1.0, 0.25)]
    assert curves["es-grpo"] == [(0.0, 1.0), (0.25, 0.9), (0.25, 0.9), (0.4375, 0.4), (1.0, 0.2)]
    assert "GRPO" not in curves


def test_budget_is_what_each_method_spends():
    from espert.experiments.compare.config import Budget

    cc = CompareConfig.fast()
    assert Budget.of(cc) == Budget("rollouts", cc.es_rollouts())
    used = {"rollouts": 10, "prompt_tokens": 70, "generated_tokens": 30}
    assert Budget("tokens", 100).done(used, 0.0) and not Budget("tokens", 101).done(used, 0.0)
    assert Budget("rollouts", 10).done(used, 0.0) and Budget("rollouts", 10).steps(3) == 4
    # seconds count from t0 (a clock time): an hour after a start just now is not spent, one ago is
    now = time.time()
    assert Budget("seconds", 3600).steps(3) is None and not Budget("seconds", 3600).done(used, now)
    assert Budget("seconds", 3600).done(used, now - 3601)
    for bad, match in (
        (dict(budget="seconds"), "needs --budget-value"),
        (dict(budget="flops", budget_value=1.0), "use one of rollouts, tokens, seconds"),
    ):
        with pytest.raises(ValueError, match=match):
            Budget.of(dataclasses.replace(cc, **bad))
    for methods in ("es,es", "es,sft", ""):
        with pytest.raises(ValueError, match="--methods"):
            dataclasses.replace(cc, methods=methods).arms()


def test_equal_wall_clock_for_every_method(tmp_path, capsys):
    """--budget seconds: ES, ES+AWD, GRPO and RandOpt each train until they have spent the same seconds (the
    first check past them), the report says so per method, and RandOpt's ensemble is evaluated by vote."""
    out = str(tmp_path / "cmp")
    argv = ["compare", "--out", out, "--fast", "--methods", "es,es_awd,grpo,randopt", "--budget", "seconds",
            "--budget-value", "3", "--randopt-top-k", "4", "--randopt-sigmas", "0.01,0.02", "--probe-points", "0"]  # fmt: skip
    assert main(argv) == 0
    doc = json.load(open(os.path.join(out, "compare.json")))
    assert set(doc["budgets"]) == {"ES", "ES+AWD", "GRPO", "RandOpt"}
    for b in doc["budgets"].values():
        assert b["budget"] == {"kind": "seconds", "value": 3.0} and b["seconds"] >= 3.0 and b["rollouts"] > 0
    assert doc["budgets"]["RandOpt"]["members"] >= 4 and doc["budgets"]["GRPO"]["steps"] >= 1
    assert set(doc["eval"]) == {"base", "es", "es_awd", "grpo", "randopt"}
    assert doc["eval"]["randopt"]["n_samples_per_problem"] == CompareConfig.fast().n
    assert doc["drift"]["es_awd"]["overall"]["rel_l2"] < doc["drift"]["es"]["overall"]["rel_l2"]
    text = open(os.path.join(out, "report.md")).read()
    assert "| ES+AWD | 3 seconds |" in text and "| RandOpt | 3 seconds |" in text and " members |" in text
    capsys.readouterr()
    assert main(["compare", "--fast", "--methods", "es,randopt", "--randopt-top-k", "3", "--out", out + "2"]) == 2
    assert "multiple of K" in capsys.readouterr().err
