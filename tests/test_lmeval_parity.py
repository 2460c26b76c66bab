"""espert's lm-eval model (``model="espert"``, which ``espert forgetting`` shares its scorer with) against
lm-evaluation-harness's own Hugging Face backend (``lm_eval.models.huggingface.HFLM``) on the same weights,
request by request: log-likelihoods (|Δ| ≤ 1e-4, float32), ``is_greedy``, rolling log-likelihoods and greedy
``generate_until`` strings, then a multiple-choice accuracy computed from each backend's numbers.

Two tokenizers: espert's tiny Llama (character tokenizer that adds ``<s>``) and the BPE tokenizer of
tests/fixtures/tiny_model.py on a Qwen2 (adds nothing).  Measured before the fix: espert scored the tiny
Llama without its BOS (``add_special_tokens=False``) and disagreed with lm-eval's HF backend by up to 9 nats per
request (acc 0.30 against 0.40 on a 40-item task).  CI runs the BOS tokenizer; ESPERT_SLOW=1 both.
"""

from __future__ import annotations

import os
import sys

import pytest

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

import espert.eval.lmeval  # noqa: E402, F401
from espert.eval.lmeval import EspertLM  # noqa: E402

CONTEXTS = ["mnbi>", "cafe>", "ab>", "", "fed> ", "dcba>"]
CHOICES = ["pmjp", "lgej", "mnbi", "ibnm", "cafe", "efac"]
ROLLING = ["abcdef>fedcba", "cafe>cafe", "a", "ba>ab ba>ab"]
GENERATE = [("cafe>", {"until": ["\n"], "max_gen_toks": 6}), ("ab>", {"until": ["e"], "max_gen_toks": 8}),
            ("fed>", {"until": [], "max_gen_toks": 5, "do_sample": False})]  # fmt: skip


def _model(kind: str, tmp_path) -> str:
    d = str(tmp_path / kind)
    if kind == "bos":  # espert's tiny Llama: its tokenizer prepends <s>
        from espert.tiny import TinySpec, build_tiny_model

        build_tiny_model(d, seed=0, spec=TinySpec(alphabet="abcdefgijlmnp> "))
    else:  # a Qwen2 with a BPE tokenizer that adds no special token
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))
        from tiny_model import build_tiny_model

        build_tiny_model(d, seed=0, arch="qwen2")
    return d


def _requests(kind: str, args: list) -> list:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


@pytest.mark.parametrize("kind", ["bos", pytest.param("no_bos", marks=pytest.mark.extended)])
def test_espert_lm_matches_lm_evals_hf_backend(kind, tmp_path):
    path = _model(kind, tmp_path)
    ours = EspertLM(pretrained=path, dtype="float32", batch_size=4)
    theirs = HFLM(pretrained=path, device="cpu", dtype="float32", batch_size=4)
    adds_bos = ours.tok("ab")["input_ids"][:1] == [ours.tok.bos_token_id]
    assert adds_bos == (kind == "bos")

    pairs = [(c, x) for c in CONTEXTS for x in CHOICES]
    a = ours.loglikelihood(_requests("loglikelihood", pairs))
    b = theirs.loglikelihood(_requests("loglikelihood", pairs))
    worst = max(abs(x[0] - y[0]) for x, y in zip(a, b))
    assert worst <= 1e-4, (kind, worst)
    assert [x[1] for x in a] == [y[1] for y in b]

    a = ours.loglikelihood_rolling(_requests("loglikelihood_rolling", [(s,) for s in ROLLING]))
    b = theirs.loglikelihood_rolling(_requests("loglikelihood_rolling", [(s,) for s in ROLLING]))
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-4, (a, b)

    a = ours.generate_until(_requests("generate_until", GENERATE))
    b = theirs.generate_until(_requests("generate_until", GENERATE))
    assert a == b

    # the multiple-choice metric each backend's numbers give: context i's gold is choice i % len(CHOICES)
    def acc(lls):
        n = len(CHOICES)
        rows = [lls[i * n : (i + 1) * n] for i in range(len(CONTEXTS))]
        return sum(max(range(n), key=lambda j: r[j][0]) == i % n for i, r in enumerate(rows)) / len(rows)

    assert acc(ours.loglikelihood(_requests("loglikelihood", pairs))) == acc(
        theirs.loglikelihood(_requests("loglikelihood", pairs))
    )
