"""The ES estimator and its bookkeeping on known objectives (no language model).

A small float32 tensor is the whole model; the reward is an analytic function of it, evaluated
through the real perturb / restore / fused-update path of a CenterStore.
"""

import math

import numpy as np
import pytest
import torch

from espert.center import CenterStore
from espert.es import ESConfig, coefficients, es_step, normalize, population, prompt_indices, schedule
from espert.evaluators import ModelEvaluator
from espert.params import ParamView

D = 32


class FunctionEvaluator(ModelEvaluator):
    """Reward = fn(live weight) for every prompt; ``nan_members`` get nan (failed members)."""

    def __init__(self, w: torch.Tensor, fn, nan_members=()):
        self.w = w
        super().__init__(CenterStore([ParamView("theta", w)]))
        self.fn = fn
        self.nan_members = set(nan_members)
        self.calls = 0

    def rollout(self, prompts, answers):
        i = self.calls
        self.calls += 1
        r = math.nan if i in self.nan_members else float(self.fn(self.w.double()))
        return [r] * len(prompts)


def cfg_(**kw):
    base = dict(population=1000, sigma=0.05, alpha=1.0, iterations=10, prompts_per_iteration=1, eval_size=0)
    base.update(kw)
    return ESConfig(**base)


def update_direction(ev: FunctionEvaluator, cfg: ESConfig, t: int = 1) -> torch.Tensor:
    before = ev.center.centers[0].clone()
    es_step(ev, cfg, t, ["p"], ["a"])
    return (ev.center.centers[0] - before).double()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.dot(a.flatten(), b.flatten()) / (a.norm() * b.norm()))


def start_point(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(D, generator=g), torch.randn(D, generator=g)


@pytest.mark.parametrize("normalization", ["zscore", "rank"])
@pytest.mark.parametrize("objective", ["linear", "quadratic"])
def test_update_direction_matches_gradient(objective, normalization):
    theta, g = start_point()
    if objective == "linear":
        fn, grad = (lambda w: float(torch.dot(w, g.double()))), g.double()
    else:
        target = theta + 0.5 * g
        fn = lambda w: -float(((w - target.double()) ** 2).sum())  # noqa: E731
        grad = -2 * (theta - target).double()
    ev = FunctionEvaluator(theta.clone(), fn)
    d = update_direction(ev, cfg_(normalization=normalization))
    assert cosine(d, grad) > 0.9
    # the live weight is back at the exact (updated) center
    assert torch.equal(ev.w, ev.center.centers[0])


def estimator_spread(antithetic: bool, repeats: int = 8, n: int = 128) -> float:
    """Mean squared distance of the unit-normalized update from the true gradient direction."""
    theta, g = start_point(1)
    target = theta + 0.05 * g  # near the optimum: the σ² curvature term dominates single rewards
    fn = lambda w: -float(((w - target.double()) ** 2).sum())  # noqa: E731
    grad = -2 * (theta - target).double()
    grad = grad / grad.norm()
    errs = []
    for rep in range(repeats):
        ev = FunctionEvaluator(theta.clone(), fn)
        d = update_direction(ev, cfg_(population=n, sigma=0.5, antithetic=antithetic, seed=rep))
        errs.append(float(((d / d.norm() - grad) ** 2).sum()))
    return float(np.mean(errs))


def test_antithetic_lowers_variance_on_quadratic():
    anti, plain = estimator_spread(True), estimator_spread(False)
    assert anti < 0.5 * plain, (anti, plain)


def test_normalize_rules():
    z = normalize([1.0, 2.0, 3.0, math.nan], "zscore")
    assert z[3] == 0.0
    assert np.allclose(z[:3].mean(), 0) and np.allclose(z[:3].std(), 1)
    for m in ("zscore", "rank"):
        assert not normalize([0.3] * 7, m).any()  # all equal -> zero update, no nan
        assert not normalize([0.1, 0.1, 0.1], m).any()  # sums that round differently are still "equal"
        assert not normalize([math.nan] * 4, m).any()
        assert not normalize([0.5, math.nan], m).any()  # one valid member: nothing to compare
        assert np.isfinite(normalize([1e-300, 2e-300, math.nan], m)).all()
    r = normalize([5.0, 1.0, 3.0, 3.0, math.nan], "rank")
    assert r.tolist() == [0.5, -0.5, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="normalization"):
        normalize([1.0, 2.0], "minmax")


def test_coefficients_combine_antithetic_pairs_and_drop_failed():
    members = [(11, 1), (11, -1), (22, 1), (22, -1)]
    rewards = [3.0, 1.0, math.nan, 2.5]
    z = normalize(rewards, "zscore")
    seeds, coeffs = coefficients(members, rewards, z, alpha=0.3)
    rv = np.array([3.0, 1.0, 2.5])
    zv = (rv - rv.mean()) / rv.std()
    assert seeds == [11, 22]
    assert coeffs == pytest.approx([0.3 / 3 * (zv[0] - zv[1]), 0.3 / 3 * (-zv[2])])
    # equal rewards inside a pair cancel: that seed is left out of the update
    seeds, _ = coefficients(members, [1.0, 1.0, 2.0, 0.0], normalize([1.0, 1.0, 2.0, 0.0]), 1.0)
    assert seeds == [22]


def test_nan_member_dropped_and_run_continues():
    theta, g = start_point(2)
    fn = lambda w: float(torch.dot(w, g.double()))  # noqa: E731
    cfg = cfg_(population=8, sigma=0.1, alpha=0.2)
    ev = FunctionEvaluator(theta.clone(), fn, nan_members={1, 4})
    rec = es_step(ev, cfg, 1, ["p"], ["a"])
    assert rec["reward"]["n_valid"] == 6 and rec["rewards"][1] is None and rec["rewards"][4] is None
    assert not rec["skipped"] and len(rec["seeds"]) == 4
    # the same update, computed by hand from the valid members only
    members = population(cfg, 1)
    exp = theta.clone()
    rewards = rec["rewards"]
    valid = [r is not None for r in rewards]
    rv = np.array([r for r in rewards if r is not None])
    zv = iter((rv - rv.mean()) / rv.std())
    acc = {}
    for (s, sign), ok in zip(members, valid):
        if ok:
            acc[s] = acc.get(s, 0.0) + sign * next(zv)
    from espert import ops

    ops.es_update_(exp, list(acc), [0.2 * v / 6 for v in acc.values()], ev.center.views[0].key)
    assert torch.equal(ev.center.centers[0], exp)


def test_all_failed_members_skip_update():
    theta, _ = start_point(3)
    ev = FunctionEvaluator(theta.clone(), lambda w: 0.0, nan_members=set(range(8)))
    rec = es_step(ev, cfg_(population=8, weight_decay=0.1, alpha=0.5), 1, ["p"], ["a"])
    assert rec["skipped"] and rec["seeds"] == [] and rec["decay"] == 1.0 and rec["reward"]["n_valid"] == 0
    assert torch.equal(ev.center.centers[0], theta)


def test_equal_rewards_zero_update_and_weight_decay():
    theta, _ = start_point(4)
    ev = FunctionEvaluator(theta.clone(), lambda w: 1.0)
    rec = es_step(ev, cfg_(population=8), 1, ["p"], ["a"])
    assert rec["seeds"] == [] and torch.equal(ev.center.centers[0], theta)
    rec = es_step(ev, cfg_(population=8, alpha=0.5, weight_decay=0.2), 2, ["p"], ["a"])
    assert rec["decay"] == pytest.approx(0.9)
    assert torch.equal(ev.center.centers[0], theta * 0.9) and torch.equal(ev.w, theta * 0.9)


def test_seeds_prompts_and_schedules_are_deterministic():
    cfg = ESConfig(population=6, seed=7, prompts_per_iteration=5)
    assert population(cfg, 3) == population(ESConfig(population=6, seed=7), 3)
    assert population(cfg, 3) != population(cfg, 4)
    assert [s for s, _ in population(cfg, 1)][::2] == [s for s, _ in population(cfg, 1)][1::2]  # pairs share
    assert [sg for _, sg in population(cfg, 1)] == [1, -1] * 3
    seeds = [s for s, _ in population(ESConfig(population=6, antithetic=False), 1)]
    assert len(set(seeds)) == 6 and all(0 <= s < 2**64 for s in seeds)
    # documented derivation: sha256("espert/member/0/1/0")[:8], little-endian
    import hashlib

    assert seeds[0] == int.from_bytes(hashlib.sha256(b"espert/member/0/1/0").digest()[:8], "little")
    idx = prompt_indices(cfg, 2, 100)
    assert idx == prompt_indices(cfg, 2, 100) and len(set(idx)) == 5 and idx != prompt_indices(cfg, 3, 100)
    assert prompt_indices(cfg, 2, 4) == [0, 1, 2, 3]
    assert schedule("constant", 1.0, None, 5, 10) == 1.0
    assert schedule("linear", 1.0, 0.0, 1, 11) == 1.0 and schedule("linear", 1.0, 0.0, 6, 11) == 0.5
    assert schedule("linear", 1.0, 0.0, 11, 11) == 0.0
    assert schedule("cosine", 1.0, 0.0, 1, 11) == 1.0 and abs(schedule("cosine", 1.0, 0.0, 11, 11)) < 1e-12
    assert schedule("cosine", 1.0, 0.0, 6, 11) == pytest.approx(0.5)


def test_schedules_reach_the_step():
    theta, g = start_point(5)
    ev = FunctionEvaluator(theta.clone(), lambda w: float(torch.dot(w, g.double())))
    cfg = cfg_(
        population=4,
        iterations=3,
        sigma=0.1,
        sigma_schedule="linear",
        sigma_end=0.05,
        alpha=0.2,
        alpha_schedule="cosine",
        alpha_end=0.0,
    )
    recs = [es_step(ev, cfg, t, ["p"], ["a"]) for t in (1, 2, 3)]
    assert [r["sigma"] for r in recs] == pytest.approx([0.1, 0.075, 0.05])
    assert [r["alpha"] for r in recs] == pytest.approx([0.2, 0.1, 0.0])
    assert recs[2]["seeds"] == [] and recs[2]["coeffs"] == []  # α = 0: nothing to apply


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="unknown config key.*populaton"):
        ESConfig.from_dict({"populaton": 8})
    with pytest.raises(ValueError, match="even population"):
        ESConfig(population=5)
    assert ESConfig(population=5, antithetic=False).population == 5
    with pytest.raises(ValueError, match="sigma must be"):
        ESConfig(sigma=0.0)
    with pytest.raises(ValueError, match="alpha_schedule='cosine' needs alpha_end"):
        ESConfig(alpha_schedule="cosine")
    with pytest.raises(ValueError, match="population must be an integer"):
        ESConfig.from_dict({"population": "8"})
    with pytest.raises(ValueError, match="normalization"):
        ESConfig(normalization="minmax")
    assert ESConfig.from_dict({"sigma": 1, "include": "mlp"}).include == ["mlp"]
    assert ESConfig.from_dict({"max-new-tokens": 3}).max_new_tokens == 3
