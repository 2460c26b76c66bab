"""ES diagnostics (espert.diagnostics) on objectives where their values are known, and the
``espert analyze run / estimator`` sub-commands and drift warnings built on them."""

import json
import os
import shutil
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from espert import diagnostics as dg

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))
from tiny_model import build_tiny_model  # noqa: E402

import espert.eval.analyze as an  # noqa: E402
import espert.eval.diagnose as run_diag  # noqa: E402
from espert.cli import main  # noqa: E402


def _pairs(xp, xm):
    members, rewards = [], []
    for k, (a, b) in enumerate(zip(xp, xm)):
        members += [(k, 1), (k, -1)]
        rewards += [a, b]
    return members, rewards


def test_linear_reward_is_perfectly_anticorrelated():
    rng = np.random.default_rng(0)
    g = rng.standard_normal(32) * 0.1  # X± = a ± σ g·ε: only an odd part
    s = dg.antithetic_stats(*_pairs(0.5 + g, 0.5 - g))
    assert s["pairs"] == 32
    assert s["corr_pm"] == pytest.approx(-1.0, abs=1e-12)
    assert s["kappa"] == pytest.approx(1.0) and s["kappa_eval"] == pytest.approx(2.0)
    assert s["var_even"] == pytest.approx(0.0, abs=1e-20)


def test_even_reward_is_cancelled_by_antithetic_pairs():
    rng = np.random.default_rng(1)
    c = rng.standard_normal(16) * 0.1  # X± = a + c (curvature / prompt difficulty): only an even part
    s = dg.antithetic_stats(*_pairs(0.5 + c, 0.5 + c))
    assert s["corr_pm"] == pytest.approx(1.0) and s["kappa"] == pytest.approx(0.0, abs=1e-12)


def test_kappa_is_half_of_one_minus_rho_at_equal_variances():
    rng = np.random.default_rng(2)
    odd, even = rng.standard_normal(4000), rng.standard_normal(4000)
    s = dg.antithetic_stats(*_pairs(even + odd, even - odd))
    # exact identity (population variances): kappa = Var A / (Var A + Var S)
    assert s["kappa"] == pytest.approx(s["var_anti"] / (s["var_anti"] + s["var_even"]), rel=1e-12)
    assert s["kappa"] == pytest.approx((1 - s["corr_pm"]) / 2, abs=0.02)


def test_antithetic_stats_drops_failed_members_and_small_populations():
    s = dg.antithetic_stats(
        [(1, 1), (1, -1), (2, 1), (2, -1), (3, 1), (3, -1)], [0.1, 0.2, float("nan"), 0.3, 0.5, 0.1]
    )
    assert s["pairs"] == 2
    assert dg.antithetic_stats([(1, 1), (1, -1)], [0.1, 0.2])["corr_pm"] is None
    assert dg.antithetic_stats(*_pairs([0.3, 0.3], [0.1, 0.5]))["corr_pm"] is None  # X+ constant


def test_js_divergence_known_values():
    assert dg.js_divergence([{"a": 3}, {"a": 1}]) == 0.0
    assert dg.js_divergence([{"a": 1}, {"b": 5}]) == pytest.approx(1.0)
    assert dg.js_divergence([{"a": 1}, {"b": 1}, {"c": 1}, {"d": 1}]) == pytest.approx(2.0)
    # two members, each 50/50 over {a,b} vs {a,c}: H(mix) = 1.5, mean H = 1 -> 0.5 bit
    assert dg.js_divergence([{"a": 1, "b": 1}, {"a": 1, "c": 1}]) == pytest.approx(0.5)


def test_population_js_known_values():
    # member_answers[member][prompt]; every member answers alike -> 0
    same = dg.population_js([["7", "x"]] * 8)
    assert same == {"js": 0.0, "prompts": 2, "abstain": 0.0}
    # N members with pairwise different answers on every prompt -> the maximum log2(N)
    for n in (2, 4, 8):
        assert dg.population_js([[f"a{m}", f"b{m}"] for m in range(n)])["js"] == pytest.approx(np.log2(n))
    # by hand, 4 members: prompt 0 answers a,a,b,c: H(1/2,1/4,1/4) = 1.5 bits; prompt 1 x,x,x and one
    # abstention: 0; prompt 2 only one answering member: left out.  Mean over 2 prompts = 0.75 bits
    res = dg.population_js([["a", "x", None], ["a", "x", None], ["b", "x", None], ["c", None, "y"]])
    assert res["js"] == pytest.approx(0.75) and res["prompts"] == 2 and res["abstain"] == pytest.approx(4 / 12)
    assert dg.population_js([[None], ["a"]]) == {"js": None, "prompts": 0, "abstain": 0.5}
    with pytest.raises(ValueError, match="same prompts"):
        dg.population_js([["a"], ["a", "b"]])


def test_population_js_counts_equivalent_answers_as_one():
    from espert.tasks.rewards import answer_equivalence

    members = [["0.5"], ["1/2"], ["0.50"], ["2"]]
    # GSM8K: 0.5 = 1/2 = 0.50, so 3:1 -> H(3/4, 1/4) = 0.811 bits; as strings 4 answers -> 2 bits
    h = -(0.75 * np.log2(0.75) + 0.25 * np.log2(0.25))
    assert dg.population_js(members, answer_equivalence("gsm8k"))["js"] == pytest.approx(h)
    assert dg.population_js(members)["js"] == pytest.approx(2.0)
    assert dg.population_js([["\\frac{1}{2}"], ["0.5"]], answer_equivalence("math500"))["js"] == 0.0


def test_population_js_is_the_js_of_the_members_prompt_answer_distributions():
    # docs/eval.md: with every member answering, the mean over prompts of the per-prompt JS equals the
    # generalized JS of each member's distribution over (prompt, answer) pairs, uniform over prompts
    rng = np.random.default_rng(3)
    answers = rng.integers(0, 3, size=(6, 10)).astype(str).tolist()
    joint = [{(p, a): 1 for p, a in enumerate(m)} for m in answers]
    assert dg.population_js(answers)["js"] == pytest.approx(dg.js_divergence(joint), abs=1e-12)


def test_flops_and_iteration_diagnostics():
    assert dg.forward_flops(83_000, 10) == 2 * 83_000 * 10
    rec = {"members": [[1, 1], [1, -1], [2, 1], [2, -1]], "rewards": [0.6, 0.4, 0.7, 0.3]}
    d = dg.iteration_diagnostics(rec, n_params=100, tokens=50, flops_before=1e4)
    assert d["antithetic"]["corr_pm"] == pytest.approx(-1.0)
    assert d["spread"]["range"] == pytest.approx(0.4)
    assert d["flops"] == 1e4 and d["flops_total"] == 2e4
    assert "flops" not in dg.iteration_diagnostics(rec)


class _LinearEvaluator:
    """A real center (espert's perturb/restore kernels) under a linear reward 0.5 + w·(θ − θ0) + d_prompt."""

    def __init__(self, n=4096, seed=0):
        from espert.center import CenterStore
        from espert.evaluators import ModelEvaluator
        from espert.params import ParamView

        g = torch.Generator().manual_seed(seed)
        self.theta = torch.randn(n, generator=g) * 0.02
        self.theta0 = self.theta.clone()
        self.w = torch.randn(n, generator=g) / n**0.5
        outer = self

        class Ev(ModelEvaluator):
            def rollout(self, prompts, answers):
                lin = float(outer.w @ (outer.theta - outer.theta0))
                return [0.5 + lin + float(a) for a in answers]

        self.ev = Ev(CenterStore([ParamView("lin.weight", self.theta)], master_dtype=torch.float32))


def test_estimator_variance_on_a_linear_objective():
    lin = _LinearEvaluator()
    prompts = [f"p{i}" for i in range(64)]
    answers = [str(0.2 * ((i * 37) % 64) / 64) for i in range(64)]  # prompt "difficulty" offsets in [0, 0.2)
    res = dg.estimator_variance(lin.ev, prompts, answers, sigma=0.01, pairs=12, per_member=8, seed=0)
    common, indep = res["common"], res["independent"]
    assert common["corr_pm"] == pytest.approx(-1.0, abs=1e-4)  # shared prompts: the offset cancels exactly
    assert common["kappa"] == pytest.approx(1.0, abs=1e-4)
    # independent prompt sets: prompt noise enters the antithetic difference
    assert indep["corr_pm"] > -0.9 and indep["var_anti"] > 1.5 * common["var_anti"]
    assert torch.equal(lin.theta, lin.theta0)  # every member restored exactly
    with pytest.raises(ValueError, match="pairs >= 2"):
        dg.estimator_variance(lin.ev, prompts, answers, 0.01, pairs=1)


# ---- drift: zero-drift groups and dtype warnings ----------------------------------------------------


def test_drift_warns_when_a_bf16_checkpoint_is_compared_to_an_fp32_base(tmp_path, capsys):
    base = build_tiny_model(str(tmp_path / "base"))
    ckpt = str(tmp_path / "bf16")
    shutil.copytree(base, ckpt)
    sd = load_file(os.path.join(base, "model.safetensors"))
    save_file(
        {k: v.to(torch.bfloat16) for k, v in sd.items()},
        os.path.join(ckpt, "model.safetensors"),
        metadata={"format": "pt"},
    )
    res = an.compute_drift(base, ckpt)
    assert len(res["warnings"]) == 1 and "BF16 rounding counts as change" in res["warnings"][0]
    assert an.compute_drift(base, base)["warnings"] == []
    assert main(["analyze", "--base", base, "--ckpt", ckpt]) == 0
    assert "warning" in capsys.readouterr().err


def test_zero_drift_groups_are_marked(tmp_path):
    base = build_tiny_model(str(tmp_path / "base"))
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(base, ckpt)
    sd = load_file(os.path.join(base, "model.safetensors"))
    save_file(
        {k: (v if "norm" in k else v + 1e-3) for k, v in sd.items()},
        os.path.join(ckpt, "model.safetensors"),
        metadata={"format": "pt"},
    )
    res = an.compute_drift(base, ckpt)
    assert res["groups"]["norm"]["n_changed"] == 0
    assert "norm 0 (unchanged)" in an.format_drift_summary("ckpt", res)
    paths = an.plot_drift({"ckpt": res}, str(tmp_path / "plots"))
    assert all(os.path.getsize(p) > 0 for p in paths)


# ---- espert analyze run -----------------------------------------------------------------------------


def test_analyze_run_on_a_logged_run(tmp_path, capsys):
    from espert.runs import LOG

    d = tmp_path / "run"
    d.mkdir()
    rng = np.random.default_rng(0)
    with open(d / LOG, "w") as f:
        for t in range(1, 6):
            g = rng.standard_normal(4) * 0.05
            members = [[k, s] for k in range(4) for s in (1, -1)]
            rewards = [float(0.5 + s * g[k]) for k in range(4) for s in (1, -1)]
            f.write(
                json.dumps(
                    {
                        "kind": "iter",
                        "iteration": t,
                        "members": members,
                        "rewards": rewards,
                        "reward": {"mean": 0.5},
                        "seeds": [],
                        "coeffs": [],
                        "decay": 1.0,
                        "diagnostics": {"flops_total": 1e6 * t},
                    }
                )
                + "\n"
            )
        f.write(json.dumps({"kind": "eval", "iteration": 5, "mean": 0.5, "n": 4}) + "\n")
    res = run_diag.run_diagnostics(str(d))
    assert [r["iteration"] for r in res["rows"]] == [1, 2, 3, 4, 5]
    assert all(r["corr_pm"] == pytest.approx(-1.0) for r in res["rows"])
    assert res["rows"][-1]["flops_total"] == 5e6
    assert main(["analyze", "run", str(d), "--plot-dir", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    assert "Corr(X+,X-) -1.000" in out and "5.000e+06" in out
    assert os.path.getsize(tmp_path / "p" / "estimator.png") > 0
    assert main(["analyze", "run", str(tmp_path / "nope")]) == 2
    assert "no run log" in capsys.readouterr().err
    assert "answer JS n/a bits" in out  # a log written before answer diversity was logged
    # a run resumed by a version that logs answer diversity: iterations 3-5 have it
    recs = [json.loads(line) for line in open(d / LOG)]
    with open(d / LOG, "w") as f:
        for r in recs:
            if r.get("iteration", 0) >= 3 and r["kind"] == "iter":
                r["diagnostics"]["answers"] = {"js": 0.1 * r["iteration"], "prompts": 4, "abstain": 0.0}
            f.write(json.dumps(r) + "\n")
    res = run_diag.run_diagnostics(str(d))
    assert [r["answer_js"] for r in res["rows"]] == [None, None, pytest.approx(0.3), pytest.approx(0.4), 0.5]
    assert main(["analyze", "run", str(d), "--plot-dir", str(tmp_path / "p2")]) == 0
    out = capsys.readouterr().out
    assert "first half: " in out and "answer JS n/a bits" in out and "answer JS 0.400 bits" in out
    assert os.path.getsize(tmp_path / "p2" / "estimator.png") > 0


def test_training_logs_per_iteration_diagnostics(tmp_path):
    from espert.config import ESConfig
    from espert.evaluators.torch_model import build
    from espert.runs import BASE, LOG, iteration_records, read_log
    from espert.tasks import load_task
    from espert.tasks.rewards import answer_equivalence
    from espert.trainer import iteration_metrics, train

    d = str(tmp_path / "run")
    cfg = ESConfig(
        iterations=2, population=4, prompts_per_iteration=4, eval_size=4, checkpoint_every=0, pretrain_steps=0
    )
    train(cfg, d, progress=False, echo=None)
    recs = iteration_records(read_log(os.path.join(d, LOG)))
    assert len(recs) == 2
    n_params = 83_648  # the tiny model
    total = 0.0
    answers = []
    for rec in recs:
        diag = dict(rec["diagnostics"])
        answers.append(diag.pop("answers"))  # from the members' answers, which the log does not keep: below
        want = dg.iteration_diagnostics(rec, n_params, diag["tokens"], total)
        assert diag == json.loads(json.dumps(want))  # what the log holds is recomputable
        js = answers[-1]["js"]
        assert 0.0 <= js <= 2.0 and 1 <= answers[-1]["prompts"] <= 4  # 4 members: at most log2(4) bits
        assert iteration_metrics(rec)["answers/js"] == js  # what trackers get
        assert diag["antithetic"]["pairs"] == 2 and diag["spread"]["n"] == 4
        # 4 members x 4 prompts: prompts of 6-8 tokens (<s>, 4-6 letters, '>') plus 1-8 generated tokens each
        assert 16 * 7 <= diag["tokens"] <= 16 * (8 + 8)
        total += diag["flops"]
        assert diag["flops_total"] == total
    # iteration 1 scored members of the base model: scoring them again gives the answers it logged
    task = load_task(cfg.task, "train", n=cfg.train_size)
    ev = build(cfg, os.path.join(d, BASE), task.score, task.extract)
    idx = recs[0]["prompt_indices"]
    ev.evaluate(
        [tuple(m) for m in recs[0]["members"]],
        recs[0]["sigma"],
        [task.prompts[i] for i in idx],
        [task.answers[i] for i in idx],
    )
    assert answers[0] == dg.population_js(ev.member_answers, answer_equivalence(cfg.task))
    rows = run_diag.run_diagnostics(d)["rows"]
    assert [r["iteration"] for r in rows] == [1, 2] and rows[-1]["flops_total"] == total
    assert [r["answer_js"] for r in rows] == [a["js"] for a in answers]
    # a resumed run continues the cumulative count
    train(
        ESConfig(
            iterations=3, population=4, prompts_per_iteration=4, eval_size=4, checkpoint_every=0, pretrain_steps=0
        ),
        d,
        resume=True,
        progress=False,
        echo=None,
    )
    third = iteration_records(read_log(os.path.join(d, LOG)))[2]["diagnostics"]
    assert third["flops_total"] == pytest.approx(total + third["flops"], rel=1e-12)


def test_answer_diversity_in_the_loop_is_zero_for_identical_members_and_absent_without_answers(tmp_path, monkeypatch):
    from espert.config import ESConfig
    from espert.evaluators import EVALUATORS
    from espert.evaluators.torch_model import build
    from espert.runs import LOG, iteration_records, read_log
    from espert.trainer import iteration_metrics, train

    small = dict(iterations=1, population=4, prompts_per_iteration=8, eval_size=0, checkpoint_every=0, pretrain_steps=0)
    # σ so small that every member generates the base model's completions: one answer per prompt
    d = str(tmp_path / "same")
    train(ESConfig(sigma=1e-9, **small), d, progress=False, echo=None)
    (rec,) = iteration_records(read_log(os.path.join(d, LOG)))
    assert len(set(rec["rewards"])) == 1
    assert rec["diagnostics"]["answers"]["js"] == 0.0 and rec["diagnostics"]["answers"]["prompts"] >= 1
    # a third-party builder without ``extract``: its evaluator has no member_answers, the run logs no JS
    monkeypatch.setitem(EVALUATORS, "no_answers", lambda cfg, model_path, score: build(cfg, model_path, score))
    d = str(tmp_path / "plain")
    train(ESConfig(evaluator="no_answers", **small), d, progress=False, echo=None)
    (rec,) = iteration_records(read_log(os.path.join(d, LOG)))
    assert "answers" not in rec["diagnostics"] and "spread" in rec["diagnostics"]
    assert "answers/js" not in iteration_metrics(rec)
