"""Loop features of issue 14 §3: noise floor, step sizes per normalization, portable prompt subsets,
‖Δθ‖ and reward std in the log, device change on resume, decay exclusions, per-tensor σ, optimizers."""

import hashlib
import json
import math
import os
import random

import numpy as np
import pytest
import torch
from conftest import SMALL_RUN

from espert import runs, train
from espert.center import CenterStore
from espert.config import ESConfig
from espert.es import derive_seed, es_step, normalize, prompt_indices, step_norm
from espert.evaluators import ModelEvaluator
from espert.params import ParamView

ULP_REWARDS = [0.3, 0.3, 0.30000000000000004, 0.3]


def test_noise_floor_no_full_step_on_float_noise():
    # today (no floor) a one-ulp difference is blown up to a full-size step
    assert normalize(ULP_REWARDS, "zscore", 0.0).tolist() == pytest.approx([0, 0, 2.3094, 0], abs=1e-4)
    for m in ("zscore", "rank", "rank_unit"):
        z = normalize(ULP_REWARDS, m, ESConfig().reward_std_floor)
        assert np.abs(z).max() < 1e-9, (m, z)
    # above the floor nothing changes, bit for bit (old runs' steps are unchanged)
    r = [0.1, 0.4, 0.35, 0.2, 0.9, 0.0]
    for m in ("zscore", "rank"):
        assert normalize(r, m, 1e-6).tobytes() == normalize(r, m, 0.0).tobytes()
    # just below: the step shrinks in proportion std/floor
    r = [0.5, 0.5 + 1e-7, 0.5 - 1e-7, 0.5]
    std = float(np.std(r))
    assert normalize(r, "zscore", 1e-6) == pytest.approx(normalize(r, "zscore", 0.0) * std / 1e-6)


def test_rank_unit_takes_zscore_sized_steps():
    rng = np.random.default_rng(0)
    for n in (4, 32, 1000):
        r = rng.random(n)
        zs, rk, ru = (normalize(r, m) for m in ("zscore", "rank", "rank_unit"))
        assert zs.std() == pytest.approx(1.0) and ru.std() == pytest.approx(1.0)
        # the documented ratio of step sizes at equal alpha
        assert zs.std() / rk.std() == pytest.approx(math.sqrt(12 * (n - 1) / (n + 1)))
        assert np.array_equal(np.argsort(ru, kind="stable"), np.argsort(rk, kind="stable"))


def reference_sha256_sampler(seed, t, pool, p):
    """The documented definition (docs/training.md), written independently: a full Fisher–Yates list."""
    a = list(range(pool))
    for j in range(p):
        h = hashlib.sha256(f"espert/prompts/{seed}/{t}/{j + 1}".encode()).digest()[:8]
        r = j + int.from_bytes(h, "little") % (pool - j)
        a[j], a[r] = a[r], a[j]
    return a[:p]


def test_prompt_sampler_is_the_documented_definition():
    for seed, t, pool, p in ((0, 1, 1024, 32), (7, 300, 50, 49), (2**63, 5, 10**6, 3)):
        cfg = ESConfig(seed=seed, prompts_per_iteration=p)
        got = prompt_indices(cfg, t, pool)
        assert got == reference_sha256_sampler(seed, t, pool, p)
        assert len(set(got)) == p and all(0 <= i < pool for i in got)
    assert prompt_indices(ESConfig(prompts_per_iteration=8), 1, 8) == list(range(8))
    # the old derivation stays available, for runs that used it
    cfg = ESConfig(prompt_sampler="python_random", seed=3, prompts_per_iteration=5)
    assert prompt_indices(cfg, 2, 100) == random.Random(derive_seed("prompts", 3, 2, 0)).sample(range(100), 5)


class Quadratic(ModelEvaluator):
    def __init__(self, views, **center_kw):
        super().__init__(CenterStore(views, **center_kw))
        self.views = views

    def rollout(self, prompts, answers):
        return [-float(sum((v.tensor.double() - 0.3).pow(2).sum() for v in self.views))] * len(prompts)


def test_step_norm_is_the_size_of_the_update():
    g = torch.Generator().manual_seed(0)
    views = [ParamView("a", torch.randn(300, 200, generator=g)), ParamView("b", torch.randn(50_000, generator=g))]
    ev = Quadratic(views)
    before = [c.clone() for c in ev.center.centers]
    energy = float(sum(v.tensor.numel() for v in views))
    rec = es_step(
        ev, ESConfig(population=8, sigma=0.01, alpha=0.1, prompts_per_iteration=1), 1, ["p"], ["a"], noise_energy=energy
    )
    real = math.sqrt(sum(float((c - b).double().pow(2).sum()) for c, b in zip(ev.center.centers, before)))
    assert rec["step_norm"] == pytest.approx(real, rel=0.01)
    assert rec["step_norm"] == step_norm(rec["coeffs"], energy)
    assert rec["reward"]["std"] > 0


SMALL = dict(
    pretrain_steps=0,  # random-init tiny base (pretraining costs ~30 s and is not what these tests check)
    iterations=3,
    population=4,
    prompts_per_iteration=4,
    train_size=32,
    eval_size=4,
    max_new_tokens=3,
    checkpoint_every=1,
    eval_every=2,
    sigma=0.05,
    alpha=0.05,
)


def log(run_dir):
    return runs.read_log(os.path.join(run_dir, runs.LOG))


def its(run_dir):
    return [r for r in log(run_dir) if r["kind"] == "iter"]


def center(run_dir):
    return runs.load_center(os.path.join(run_dir, runs.CENTER))[0]


def same_center(a, b):
    ca, cb = center(a), center(b)
    return ca.keys() == cb.keys() and all(torch.equal(ca[k], cb[k]) for k in ca)


@pytest.fixture(scope="module")
def ref_run(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("loop") / "ref")
    train(ESConfig(**SMALL), d, progress=False, echo=None)
    return d


def test_every_iteration_logs_reward_std_and_step_norm(ref_run):
    for r in its(ref_run):
        assert r["reward"]["std"] is not None and r["step_norm"] is not None
        assert r["step_norm"] == pytest.approx(math.sqrt(83_000 * sum(c * c for c in r["coeffs"])), rel=0.05)
    config, task = log(ref_run)[:2]  # the log opens with the settings that cannot change, then the task
    assert (
        config["kind"] == "config" and task["kind"] == "task" and task["spec"] == "copy" and task["source"] == "builtin"
    )


def test_resume_on_another_device_string(ref_run, tmp_path):
    """device is no longer locked: the run resumes on another device and the weights stay exact."""
    d = str(tmp_path / "run")
    train(ESConfig(**{**SMALL, "iterations": 2}), d, progress=False, echo=None)
    train(ESConfig(**{**SMALL, "device": "cpu:0"}), d, resume=True, progress=False, echo=None)
    assert same_center(d, ref_run)
    assert runs.read_run_config(d)["config"]["device"] == "cpu:0"


@pytest.mark.parametrize("dtype,sigma", [("bfloat16", 1e-3), ("float32", 0.05)])
def test_restore_patch_runs_give_the_copy_runs_center(tmp_path, monkeypatch, dtype, sigma):
    """restore: patch (subtraction + the patch list), also switched on at resume, gives the copy run's
    bits.  bf16 at σ = 1e-3: the members are restored by patches; float32 at σ = 0.05 on the tiny model:
    more than 1/16 of the elements miss, the lists overflow and every member falls back to a copy."""
    from espert import ops

    patched, real = [], ops.restore_patched_many_
    monkeypatch.setattr(ops, "restore_patched_many_", lambda *a, **k: patched.append(real(*a, **k)) or patched[-1])
    kw = {**SMALL, "dtype": dtype, "sigma": sigma, "eval_size": 0}
    copy, patch = str(tmp_path / "copy"), str(tmp_path / "patch")
    train(ESConfig(**kw), copy, progress=False, echo=None)
    assert patched == []
    train(ESConfig(**{**kw, "iterations": 1, "restore": "patch"}), patch, progress=False, echo=None)
    train(ESConfig(**{**kw, "restore": "patch"}), patch, resume=True, progress=False, echo=None)
    assert same_center(copy, patch)
    assert len(patched) == 3 * SMALL["population"]
    assert all(patched) if dtype == "bfloat16" else not any(patched)


def test_resume_refuses_when_logged_prompts_differ(ref_run, tmp_path):
    """Resume reads the logged prompt indices and refuses a run whose sampler no longer gives them."""
    import shutil

    d = str(tmp_path / "run")
    shutil.copytree(ref_run, d)
    path = os.path.join(d, runs.LOG)
    lines = open(path, encoding="utf-8").read().splitlines()
    out = []
    for line in lines:
        rec = json.loads(line)
        if rec.get("kind") == "iter" and rec["iteration"] == 2:
            rec["prompt_indices"] = rec["prompt_indices"][::-1]
            rec.pop("crc32", None)
            line = json.dumps(rec)  # a record without crc32, as logs before checksums
        out.append(line)
    open(path, "w", encoding="utf-8").write("\n".join(out) + "\n")
    with pytest.raises(ValueError, match="prompts logged for iteration 2 differ"):
        train(ESConfig(**{**SMALL, "iterations": 4}), d, resume=True, progress=False, echo=None)


def test_weight_decay_skips_excluded_parameters(tmp_path):
    """Default exclusions: norm gains and biases keep their values; everything else decays."""
    d = str(tmp_path / "run")
    cfg = ESConfig(**{**SMALL, "iterations": 2, "weight_decay": 0.5, "alpha": 0.5, "eval_size": 0})
    flat = lambda prompts, completions, answers: [0.5] * len(completions)  # noqa: E731 - no step, decay only
    train(cfg, d, progress=False, echo=None, reward=flat, prompts=["abc>"] * 4)
    from safetensors.torch import load_file

    base = load_file(os.path.join(d, "base_model", "model.safetensors"))
    c = center(d)
    assert [r["seeds"] for r in its(d)] == [[], []] and [r["decay"] for r in its(d)] == [0.75, 0.75]
    assert any("norm" in k for k in c)
    for k in c:
        want = base[k].float() if "norm" in k else base[k].float() * torch.tensor(0.75) * torch.tensor(0.75)
        assert torch.equal(c[k], want), k


@pytest.mark.parametrize("opt", ["momentum", "adam"])
def test_optimizers_resume_and_replay_bit_identically(opt, tmp_path):
    kw = {**SMALL, "optimizer": opt, "sigma_mode": "rms", "iterations": 3}
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    train(ESConfig(**kw), a, progress=False, echo=None)
    train(ESConfig(**{**kw, "iterations": 1}), b, progress=False, echo=None)
    train(ESConfig(**kw), b, resume=True, progress=False, echo=None)
    assert same_center(a, b)
    res = runs.replay(a, str(tmp_path / "replay"), echo=None)
    assert res["matches_checkpoint"] is True


def test_version1_run_directories_resume_and_replay(tmp_path, capsys):
    """A run directory from before config.py (key 'backend', no new fields) resumes and replays exactly."""
    import yaml

    from espert.cli import main
    from espert.runs import legacy as C

    legacy = dict(prompt_sampler="python_random", weight_decay_exclude=[], reward_std_floor=0.0)
    kw = {**SMALL, "weight_decay": 0.1, **legacy}
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    train(ESConfig(**kw), a, progress=False, echo=None)
    train(ESConfig(**{**kw, "iterations": 2}), b, progress=False, echo=None)
    path = os.path.join(b, runs.CONFIG)
    doc = yaml.safe_load(open(path, encoding="utf-8"))
    cfg = doc["config"]
    cfg["backend"] = cfg.pop("evaluator")
    doc["config"] = {k: v for k, v in cfg.items() if k in C.V1_FIELDS}
    assert set(doc["config"]) == C.V1_FIELDS
    open(path, "w", encoding="utf-8").write(yaml.safe_dump(doc, sort_keys=False))
    lines = open(os.path.join(b, runs.LOG), encoding="utf-8").read().splitlines(keepends=True)
    open(os.path.join(b, runs.LOG), "w", encoding="utf-8").write("".join(ln for ln in lines if '"task"' not in ln))
    capsys.readouterr()
    assert main(["train", "--run-dir", b, "--resume", "--iterations", "3", "--no-progress"]) == 0
    assert "config key 'backend' is deprecated" in capsys.readouterr().err
    assert same_center(a, b)
    assert [r["prompt_indices"] for r in its(a)] == [r["prompt_indices"] for r in its(b)]
    assert runs.replay(b, str(tmp_path / "replay"), echo=None)["matches_checkpoint"] is True


@pytest.mark.parametrize("noise", ["rademacher", "lowrank:2"])
def test_noise_family_is_recorded_fixed_and_replayed(noise, tmp_path):
    d = str(tmp_path / "run")
    train(ESConfig(**{**SMALL, "noise": noise, "iterations": 2}), d, progress=False, echo=None)
    assert runs.read_run_config(d)["config"]["noise"] == noise
    with pytest.raises(ValueError, match="noise"):
        train(ESConfig(**{**SMALL, "iterations": 3}), d, resume=True, progress=False, echo=None)
    train(ESConfig(**{**SMALL, "noise": noise, "iterations": 3}), d, resume=True, progress=False, echo=None)
    assert runs.replay(d, str(tmp_path / "replay"), echo=None)["matches_checkpoint"] is True
    gauss = str(tmp_path / "gauss")
    train(ESConfig(**SMALL), gauss, progress=False, echo=None)
    assert not same_center(d, gauss)


def _flat_reward(prompts, completions, answers):
    return [0.5] * len(completions)


def test_zero_reward_spread_is_said_in_log_tracker_bar_and_once_as_a_warning(tmp_path):
    """Every member scores the same: the iteration takes no step.  The record says so (zero_spread), the
    tracker gets reward/zero_spread, the progress bar shows it, and a repeat warns once, naming σ."""
    from espert.trainer import iteration_metrics

    said = []
    d = str(tmp_path / "run")
    cfg = ESConfig(**{**SMALL_RUN, "iterations": 4, "checkpoint_every": 0, "eval_every": 0, "weight_decay": 0.0})
    train(cfg, d, progress=False, echo=said.append, reward=_flat_reward, prompts=[f"p{i}" for i in range(8)])
    recs = [r for r in runs.read_log(os.path.join(d, runs.LOG)) if r.get("kind") == "iter"]
    assert [r["zero_spread"] for r in recs] == [True] * 4 and all(r["coeffs"] == [] for r in recs)
    assert iteration_metrics(recs[0])["reward/zero_spread"] == 1.0
    warnings = [s for s in said if "zero reward spread" in s]
    assert len(warnings) == 1 and "sigma=0.05" in warnings[0] and "sigma_mode" in warnings[0], said
    assert "iterations 1-2" in warnings[0]


def test_progress_bar_marks_an_iteration_without_a_step():
    from espert.trainer import bar_postfix

    rec = {"reward": {"mean": 0.5, "std": 0.0}, "zero_spread": True}
    assert bar_postfix(rec, None)["step"] == "none (zero spread)"
    assert "step" not in bar_postfix({"reward": {"mean": 0.5, "std": 0.1}, "zero_spread": False}, 0.25)
