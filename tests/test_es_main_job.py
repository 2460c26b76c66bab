"""The main job, shortened: ES on the pretrained tiny base must raise held-out reward on `copy`.

The base is the main job's own (600 pretraining steps on copy and reversed lines, about half a
minute on one core): greedy, it copies some held-out prompts and reverses others.  20 of the main
job's iterations must move it towards copying (the full run: 0.596 -> 0.914 at iteration 20 on
128 problems).  Marked slow (about a minute on 2 cores) but meant to run in CI.  Everything is seeded, so on a given platform the curve is the same
every time; the margins below leave room for other BLAS/ISA rounding paths.
"""

import json
import os

import pytest

from espert import runs, train
from espert.config import ESConfig


@pytest.mark.slow
def test_main_job_reward_rises(tmp_path):
    cfg = ESConfig(iterations=20, eval_every=10, eval_size=64, checkpoint_every=0)  # main-job defaults otherwise
    assert cfg.pretrain_steps > 0 and 0 < cfg.pretrain_reverse_share < 1
    d = str(tmp_path / "run")
    summary = train(cfg, d, progress=False, echo=None)
    meta = json.load(open(os.path.join(d, runs.BASE, "espert_tiny.json")))
    assert meta["pretrain"]["steps"] == cfg.pretrain_steps
    held = dict(summary["heldout"])
    assert set(held) == {0, 10, 20}
    assert 0.4 < held[0] < 0.8, held  # the base mixes copying and reversing
    assert held[20] >= held[0] + 0.2, held
    train_curve = [r for _, r in summary["train_reward"]]
    assert sum(train_curve[-5:]) / 5 > sum(train_curve[:5]) / 5 + 0.05, train_curve
    assert os.path.exists(os.path.join(d, runs.EXPORT, "model.safetensors"))
