"""The main job, shortened: ES on the random-init tiny model must raise held-out reward on `copy`.

Marked slow (about a minute on 2 cores) but meant to run in CI.  Everything is seeded, so on a
given platform the curve is the same every time; the margin below leaves room for other BLAS/ISA
rounding paths.
"""

import os

import pytest

from espert import runs, train
from espert.config import ESConfig


@pytest.mark.slow
def test_main_job_reward_rises(tmp_path):
    cfg = ESConfig(iterations=60, eval_every=30, eval_size=64, checkpoint_every=0)  # main-job defaults otherwise
    d = str(tmp_path / "run")
    summary = train(cfg, d, progress=False, echo=None)
    held = dict(summary["heldout"])
    assert set(held) == {0, 30, 60}
    assert held[60] >= held[0] + 0.15, held
    train_curve = [r for _, r in summary["train_reward"]]
    assert sum(train_curve[-10:]) / 10 > sum(train_curve[:10]) / 10 + 0.05, train_curve
    assert os.path.exists(os.path.join(d, runs.EXPORT, "model.safetensors"))
