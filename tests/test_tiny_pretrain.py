"""Local pretraining of the tiny model (espert.tiny.pretrain): deterministic, learns, never sees held-out strings."""

import json
import os

import torch

from espert.tasks.copy_task import COPY_SEP, is_heldout_string
from espert.tiny import build_tiny_model, pretrain_corpus


def test_corpus_is_copy_lines_over_train_strings_only():
    lines = pretrain_corpus(2000, seed=0)
    assert lines == pretrain_corpus(2000, seed=0) and lines != pretrain_corpus(2000, seed=1)
    assert len(set(lines)) == 2000
    for line in lines:
        s, t = line.split(COPY_SEP)
        assert s == t and 4 <= len(s) <= 6 and not is_heldout_string(s)


def test_pretraining_is_deterministic_and_lowers_the_loss(tmp_path):
    a = build_tiny_model(str(tmp_path / "a"), seed=0, pretrain_steps=40)
    b = build_tiny_model(str(tmp_path / "b"), seed=0, pretrain_steps=40)
    r = build_tiny_model(str(tmp_path / "r"), seed=0)
    sa, sb, sr = a.state_dict(), b.state_dict(), r.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["lm_head.weight"], sr["lm_head.weight"])
    meta = json.load(open(os.path.join(tmp_path / "a", "espert_tiny.json")))
    assert meta["pretrain"]["steps"] == 40 and meta["pretrain"]["final_loss"] < 1.9  # random init: ~2.4
    assert json.load(open(os.path.join(tmp_path / "r", "espert_tiny.json")))["pretrain"]["steps"] == 0
    assert not a.training and not any(p.requires_grad for p in a.parameters())
