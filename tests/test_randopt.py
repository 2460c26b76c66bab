"""RandOpt (method: randopt): members are pure functions of the config, the run logs every member before the
next window, resumes where its log ends and replays (its members' seeds and σ, the ensemble, any member's
weights); ``espert eval`` of the ensemble is the members' greedy answers, and its maj@K is the vote a hand
computation gives."""

import json
import os
from collections import Counter

import pytest
import torch
from conftest import SMALL_RUN

from espert import ops, randopt, runs, train
from espert.config import ESConfig
from espert.tasks import load_task

RUN = dict(
    SMALL_RUN,
    method="randopt",
    population=10,
    randopt_top_k=3,
    randopt_sigmas="0.02,0.05",
    prompts_per_iteration=8,
    eval_size=0,
    checkpoint_every=0,
)


def test_members_are_pure_functions_of_the_config():
    cfg = ESConfig(**{**RUN, "population": 64})
    pairs = [randopt.member(cfg, k) for k in range(64)]
    assert pairs == [randopt.member(ESConfig(**{**RUN, "population": 64}), k) for k in range(64)]
    assert {s for _, s in pairs} == {0.02, 0.05} and len({s for s, _ in pairs}) == 64
    assert pairs != [randopt.member(ESConfig(**{**RUN, "population": 64, "seed": 1}), k) for k in range(64)]


def test_select_top_ranks_by_reward_then_k_and_failed_last():
    recs = [{"k": k, "seed": k, "sigma": 0.1, "reward": r} for k, r in enumerate([0.5, None, 0.9, 0.5, 0.1])]
    top = randopt.select_top(recs, 4)
    assert [r["k"] for r in top] == [2, 0, 3, 4] and [r["rank"] for r in top] == [1, 2, 3, 4]
    assert randopt.select_top(recs, 5)[-1]["k"] == 1


def test_top_k_is_checked_for_randopt_only():
    """An ES config with a population below the default top K is valid; a RandOpt one is refused."""
    assert ESConfig(**{**SMALL_RUN, "population": 4}).randopt_top_k > 4
    with pytest.raises(ValueError, match="randopt_top_k"):
        ESConfig(**{**RUN, "population": 2})


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("randopt") / "run")
    train(ESConfig(**RUN), d, progress=False, echo=None)
    return d


def test_run_logs_members_and_writes_the_ensemble(run_dir):
    log = runs.read_log(os.path.join(run_dir, runs.LOG))
    members = [r for r in log if r["kind"] == "member"]
    cfg = ESConfig(**RUN)
    assert [r["k"] for r in members] == list(range(10))
    assert all((r["seed"], r["sigma"]) == randopt.member(cfg, r["k"]) for r in members)
    doc = json.load(open(os.path.join(run_dir, randopt.ENSEMBLE)))
    assert [m["rank"] for m in doc["members"]] == [1, 2, 3]
    assert [(m["seed"], m["sigma"]) for m in doc["members"]] == [
        (m["seed"], m["sigma"]) for m in randopt.select_top(members, 3)
    ]
    assert not os.path.exists(os.path.join(run_dir, runs.CENTER))  # the base is never rewritten


def test_killed_run_resumes_to_the_same_members(run_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(randopt, "WINDOW", 4)
    d = str(tmp_path / "run")
    calls = {"n": 0}

    def stop():
        calls["n"] += 1
        return calls["n"] == 2  # after the first window of 4 members

    out = train(ESConfig(**RUN), d, progress=False, echo=None, stop=stop)
    assert out["stopped"] == 4 and not os.path.exists(os.path.join(d, randopt.ENSEMBLE))
    train(None, d, resume=True, progress=False, echo=None)
    strip = lambda recs: [{k: v for k, v in r.items() if k != "time"} for r in recs if r["kind"] == "member"]  # noqa: E731
    a = runs.read_log(os.path.join(run_dir, runs.LOG))
    b = runs.read_log(os.path.join(d, runs.LOG))
    assert strip(a) == strip(b)
    ea, eb = (json.load(open(os.path.join(p, randopt.ENSEMBLE)))["members"] for p in (run_dir, d))
    assert ea == eb


def test_replay_checks_the_log_and_rebuilds_a_member(run_dir, tmp_path):
    from safetensors.torch import load_file

    res = runs.replay(run_dir, str(tmp_path / "r"), echo=None, member=2)
    doc = json.load(open(os.path.join(run_dir, randopt.ENSEMBLE)))
    seed, sigma = doc["members"][1]["seed"], doc["members"][1]["sigma"]
    assert res["randopt"]["ensemble"][1] == (seed, sigma)
    got = load_file(os.path.join(tmp_path, "r", runs.EXPORT, "model.safetensors"))
    base = load_file(os.path.join(run_dir, runs.BASE, "model.safetensors"))
    from espert.noise import param_key

    for name, w in base.items():
        want = w.float().clone()
        ops.perturb_(want, seed, param_key(name), sigma)
        assert torch.equal(got[name], want), name
    # a log whose member differs from the config's derivation is named
    log = os.path.join(run_dir, runs.LOG)
    bad = tmp_path / "bad"
    import shutil

    shutil.copytree(run_dir, bad)
    lines = open(log).read().splitlines()
    i = next(i for i, line in enumerate(lines) if '"kind": "member"' in line or '"kind":"member"' in line)
    from espert.runs.log import log_line

    rec = json.loads(lines[i])
    rec.pop("crc32")
    rec["sigma"] = 0.5
    lines[i] = log_line(rec).decode().rstrip("\n")
    open(bad / runs.LOG, "w").write("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="member 0"):
        runs.replay(str(bad), str(tmp_path / "r2"), echo=None)


def test_ensemble_vote_equals_a_hand_computation(run_dir, tmp_path):
    """espert eval of the ensemble: sample m is member m's greedy completion, and maj@K (the vote of all K)
    equals a plurality vote computed by hand from completions made with the ops directly."""
    from espert.cli import main
    from espert.evaluators import TorchEvaluator, load_model
    from espert.params import torch_param_views

    out = tmp_path / "eval"
    assert main(["eval", "--task", "copy", "--limit", "6", "--models", f"rand={run_dir}", "-n", "3",
                 "--temperature", "0", "--max-new-tokens", "5", "--maj", "first", "--out", str(out)]) == 0  # fmt: skip
    rep = json.load(open(out / "report.json"))
    doc = json.load(open(os.path.join(run_dir, randopt.ENSEMBLE)))
    task = load_task("copy", "test", n=6)
    model, tok = load_model(os.path.join(run_dir, runs.BASE))
    ev = TorchEvaluator(model, tok, task.score, max_new_tokens=5)
    answers = []
    for m in doc["members"]:
        for v in torch_param_views(model):
            ops.perturb_(v.tensor, m["seed"], v.key, m["sigma"])
        answers.append(ev.generate(task.prompts))
        ev.center.restore()
    score = 0.0
    for p, ans in enumerate(task.answers):  # plurality; a tie scores the share of tied answers that are right
        votes, right = Counter(), {}
        for member in answers:
            e = task.extract(member[p], ans)
            if e is not None:
                votes[e] += 1
                right[e] = right.get(e, True) and task.score([member[p]], [ans])[0] >= task.success_threshold
        top = max(votes.values(), default=0)
        tied = [e for e, v in votes.items() if v == top]
        score += sum(right[e] for e in tied) / len(tied) if tied else 0.0
    assert rep["models"]["rand"]["maj_at_k"]["3"] == pytest.approx(score / len(task))
    samples = [json.loads(line) for line in open(out / "samples_rand.jsonl")]
    assert [s["completions"] for s in samples] == [[a[p] for a in answers] for p in range(len(task))]


def test_ensemble_sample_count_must_be_a_multiple_of_k(run_dir, tmp_path, capsys):
    from espert.cli import main

    argv = ["eval", "--task", "copy", "--limit", "2", "--models", f"rand={run_dir}", "-n", "4", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert "multiple of 3" in capsys.readouterr().err
