"""The torch evaluator on the tiny model: exact restores, also when generation raises."""

import math

import pytest
import torch

from espert.evaluators import TorchEvaluator, load_model
from espert.tasks import load_task
from espert.update import Update


@pytest.fixture(scope="module")
def task():
    return load_task("copy", "train", n=12)


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def same(model, snap):
    return all(torch.equal(v, snap[k]) for k, v in model.state_dict().items())


class Exploding(TorchEvaluator):
    """Raises inside generation of chosen calls, after checking the weights really are perturbed."""

    def __init__(self, *a, explode_on=(0,), **kw):
        super().__init__(*a, **kw)
        self.explode_on, self.calls, self.saw_perturbed = set(explode_on), 0, []

    def generate(self, prompts):
        i = self.calls
        self.calls += 1
        c = self.center.centers[0]
        self.saw_perturbed.append(not torch.equal(self.center.views[0].tensor, c))
        if i in self.explode_on:
            raise RuntimeError("generation blew up")
        return super().generate(prompts)


def test_evaluate_restores_exactly_and_is_deterministic(tiny_dir, task):
    model, tok = load_model(tiny_dir)
    ev = TorchEvaluator(model, tok, task.score, max_new_tokens=6, batch_size=5)
    snap = snapshot(model)
    members = [(123, 1), (123, -1), (77, 1)]
    r1 = ev.evaluate(members, 0.05, task.prompts, task.answers)
    assert same(model, snap)
    r2 = ev.evaluate(members, 0.05, task.prompts, task.answers)
    assert r1 == r2 and all(0.0 <= r <= 1.0 for r in r1)
    base = ev.evaluate_center(task.prompts, task.answers)
    assert len(base) == len(task) and same(model, snap)
    # the perturbation changes the model's behaviour
    comps = [ev.generate(task.prompts)]
    ev.center.perturb(123, 0.5, 1)
    comps.append(ev.generate(task.prompts))
    ev.center.restore()
    assert comps[0] != comps[1] and same(model, snap)


def test_weights_restored_when_generation_raises(tiny_dir, task):
    model, tok = load_model(tiny_dir)
    snap = snapshot(model)
    ev = Exploding(model, tok, task.score, max_new_tokens=4, explode_on=(1,))
    with pytest.raises(RuntimeError, match="blew up"):
        ev.evaluate([(1, 1), (1, -1), (2, 1)], 0.05, task.prompts, task.answers)
    assert ev.saw_perturbed == [True, True]
    assert same(model, snap)


def test_member_errors_nan_drops_member(tiny_dir, task):
    model, tok = load_model(tiny_dir)
    snap = snapshot(model)
    ev = Exploding(model, tok, task.score, max_new_tokens=4, explode_on=(1,), member_errors="nan")
    r = ev.evaluate([(1, 1), (1, -1), (2, 1)], 0.05, task.prompts, task.answers)
    assert math.isnan(r[1]) and not math.isnan(r[0]) and not math.isnan(r[2])
    assert same(model, snap)


def test_update_moves_center_and_live_weights(tiny_dir):
    model, tok = load_model(tiny_dir)
    ev = TorchEvaluator(model, tok, lambda c, a: [0.0] * len(c), include=["mlp"])
    before = {k: v.clone() for k, v in ev.center_state().items()}
    assert all(".mlp." in k for k in before)
    ev.update(Update([5, 6], [1e-3, -2e-3], decay=0.99))
    after = ev.center_state()
    for k, v in after.items():
        assert not torch.equal(v, before[k])
        assert torch.equal(model.get_parameter(k), v)  # float32 model: live == center
    with pytest.raises(ValueError, match="finite"):
        ev.update(Update([5], [float("nan")]))
    assert all(torch.equal(v, after[k]) for k, v in ev.center_state().items())


def test_member_answers_are_each_members_extracted_answers(tiny_dir, task):
    model, tok = load_model(tiny_dir)
    members = [(123, 1), (123, -1), (77, 1)]
    plain = TorchEvaluator(model, tok, task.score, max_new_tokens=6)
    r_plain = plain.evaluate(members, 0.5, task.prompts, task.answers)
    assert plain.member_answers is None  # no extractor: no answers, nothing else changes
    ev = TorchEvaluator(model, tok, task.score, max_new_tokens=6, extract=task.extract)
    assert ev.evaluate(members, 0.5, task.prompts, task.answers) == r_plain
    want = []
    for seed, sign in members:  # by hand: perturb, generate, extract with the task, restore
        ev.center.perturb(seed, 0.5, sign)
        want.append([task.extract(c, a) for c, a in zip(ev.generate(task.prompts), task.answers)])
        ev.center.restore()
    assert ev.member_answers == want and want[0] != want[1]
    # a failed member answers nothing
    bad = Exploding(
        model, tok, task.score, max_new_tokens=6, explode_on=(1,), member_errors="nan", extract=task.extract
    )
    bad.evaluate(members, 0.5, task.prompts, task.answers)
    assert bad.member_answers == [want[0], [None] * len(task), want[2]]
