"""Local pretraining of the tiny model (espert.tiny.pretrain): deterministic, learns, never sees held-out strings."""

import json
import os

import pytest
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


def test_mixed_corpus_reverses_a_share_of_the_lines():
    copies = pretrain_corpus(2000, seed=0)
    mixed = pretrain_corpus(2000, seed=0, reverse_share=0.3)
    assert mixed == pretrain_corpus(2000, seed=0, reverse_share=0.3)
    reversed_ = 0
    for c, m in zip(copies, mixed):
        s, t = m.split(COPY_SEP)
        assert c.split(COPY_SEP)[0] == s and not is_heldout_string(s)  # same prompts as the copy corpus
        if t != s:
            assert t == s[::-1]
            reversed_ += 1
    assert 500 < reversed_ < 700  # ~30% of 2000, palindromes aside
    assert all(a.split(COPY_SEP)[1] == a.split(COPY_SEP)[0][::-1] for a in pretrain_corpus(50, 0, reverse_share=1.0))
    with pytest.raises(ValueError, match="reverse_share"):
        pretrain_corpus(10, reverse_share=1.5)


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
