"""Optional trackers: nothing is lost when one is missing, offline or failing; log.jsonl is the record."""

import os
import sys
import types

import pytest

from espert import runs, train
from espert.config import ESConfig
from espert.extras import MissingExtra
from espert.trainer import iteration_metrics

SMALL = dict(
    pretrain_steps=0,  # random-init tiny base (pretraining costs ~30 s and is not what these tests check)
    iterations=2,
    population=4,
    prompts_per_iteration=4,
    train_size=16,
    eval_size=3,
    max_new_tokens=2,
    eval_every=1,
    checkpoint_every=0,
)


def records(d):
    return runs.read_log(os.path.join(d, runs.LOG))


def run(tmp_path, name, **kw):
    d = str(tmp_path / name)
    msgs = []
    train(ESConfig(**{**SMALL, **kw}), d, progress=False, echo=msgs.append)
    return d, msgs


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("plain") / "run")
    train(ESConfig(**SMALL), d, progress=False, echo=None)
    return [{k: v for k, v in r.items() if k not in ("time", "seconds", "eval_seconds", "crc32")} for r in records(d)]


def same_log(d, plain):
    got = [{k: v for k, v in r.items() if k not in ("time", "seconds", "eval_seconds", "crc32")} for r in records(d)]
    return got == plain


@pytest.mark.parametrize("tracker", ["wandb", "tensorboard"])
def test_a_missing_tracker_package_is_refused_before_anything_is_written(tmp_path, monkeypatch, tracker):
    monkeypatch.setitem(sys.modules, tracker, None)  # `import wandb` raises ImportError
    with pytest.raises(
        MissingExtra, match=rf"--trackers {tracker} needs the {tracker} package: pip install 'espert\[track\]'"
    ):
        run(tmp_path, "run", trackers=[tracker])
    assert not os.path.exists(tmp_path / "run")


def test_a_tracker_that_cannot_start_only_warns(tmp_path, monkeypatch, plain):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # installed, but its import fails
    monkeypatch.setitem(sys.modules, "tensorboard", types.ModuleType("tensorboard"))
    d, msgs = run(tmp_path, "run", trackers=["tensorboard"])
    assert any("tracker tensorboard could not start (ModuleNotFoundError" in m for m in msgs)
    assert same_log(d, plain)


class FakeWandb(types.ModuleType):
    """The slice of the wandb API espert uses, recording calls; ``fail_after`` makes ``log`` raise (offline)."""

    def __init__(self, fail_after=None):
        super().__init__("wandb")
        self.calls, self.fail_after, self.finished = [], fail_after, False

    def init(self, **kw):
        self.init_kw = kw
        return self

    def log(self, metrics, step):
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise ConnectionError("network is unreachable")
        self.calls.append((step, dict(metrics)))

    def finish(self):
        self.finished = True


def test_a_tracker_gets_the_metrics_of_log_jsonl(tmp_path, monkeypatch, plain):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    d, msgs = run(tmp_path, "run", trackers=["wandb"], tracker_project="proj")
    assert not msgs and fake.finished and fake.init_kw["project"] == "proj"
    assert fake.init_kw["config"]["trackers"] == ["wandb"]
    its = [r for r in records(d) if r["kind"] == "iter"]
    evals = [r for r in records(d) if r["kind"] == "eval"]
    held = lambda e: {"heldout/mean": e["mean"], "heldout/token_entropy": e["token_entropy"]}  # noqa: E731
    want = [(0, held(evals[0]))]
    for r, e in zip(its, evals[1:]):
        want += [(r["iteration"], iteration_metrics(r)), (r["iteration"], held(e))]
    assert fake.calls == want
    assert all(e["token_entropy"] > 0 for e in evals)  # the random tiny model is far from certain
    assert {"reward/std", "reward/mean", "step_norm", "sigma", "alpha", "answers/js"} <= set(fake.calls[1][1])
    assert same_log(d, plain)


def test_a_failing_tracker_is_switched_off_and_the_run_goes_on(tmp_path, monkeypatch, plain):
    fake = FakeWandb(fail_after=1)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    d, msgs = run(tmp_path, "run", trackers=["wandb"])
    assert len(fake.calls) == 1
    assert len([m for m in msgs if "tracker wandb failed (ConnectionError" in m]) == 1
    assert same_log(d, plain)


def test_token_entropy_is_that_of_the_logits_and_leaves_completions_alone():
    """The held-out record's token entropy (the second seed paper's Figure 2) is the mean, over the
    generated tokens, of the entropy in bits of softmax(logits) at each step; recomputed here by hand."""
    import math

    import torch

    from espert.evaluators import TorchEvaluator, load_model
    from espert.tiny import build_tiny_model

    d = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"tiny-entropy-{os.getpid()}")
    build_tiny_model(d, seed=1, pretrain_steps=0)
    model, tok = load_model(d)
    ev = TorchEvaluator(model, tok, lambda c, a: [0.0] * len(c), max_new_tokens=4)
    prompts = ["abc>", "fed>", "a>"]
    plain = ev.generate(prompts)
    ev.evaluate_center(prompts, ["", "", ""])
    assert ev.generate(prompts) == plain
    total = count = 0.0
    for p in prompts:  # one prompt at a time, no padding: the same tokens
        ids = tok(p, return_tensors="pt").input_ids
        for _ in range(4):
            logits = model(ids).logits[0, -1].double()
            prob = logits.softmax(-1)
            total += float(-(prob * prob.log()).sum()) / math.log(2)
            count += 1
            nxt = int(logits.argmax())
            if nxt == tok.eos_token_id:
                break
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    assert ev.last_token_entropy == pytest.approx(total / count, rel=1e-5)
