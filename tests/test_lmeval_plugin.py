"""espert's models through lm-evaluation-harness's model interface (``import espert.eval.lmeval`` registers
"espert"): a local MC task from a JSONL file gives lm-eval the accuracies espert forgetting's scorer gives;
a run directory is its export; a RandOpt ensemble member is base + σ·ε(seed).  Skipped without lm-eval
(``pip install lm-eval``; 0.4.13 tested, it installs offline from the package registry), and without
ESPERT_SLOW=1: two lm-eval runs took 837 s on 2 shared cores (load 25-30), too long for CI's budget."""

import json
import os
import shutil
import sys

import pytest
import torch

if os.environ.get("ESPERT_SLOW") != "1":  # before lm-eval's import, itself slow
    pytest.skip("lm-eval plugin: set ESPERT_SLOW=1 (two lm-eval runs, minutes)", allow_module_level=True)
lm_eval = pytest.importorskip("lm_eval")

import espert.eval.lmeval  # noqa: E402, F401  (registers the model "espert")
from espert import ops  # noqa: E402
from espert.config import ESConfig  # noqa: E402
from espert.eval.mc import load_mc, loglikelihoods, score_mc  # noqa: E402
from espert.noise import param_key  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))
from tiny_model import build_tiny_model  # noqa: E402

ITEMS = [("abc", ["abc", "xyz", "cba"], 0), ("hi", ["ih", "hi", "hh"], 1), ("cafe", ["efac", "cafe"], 1),
         ("bead", ["bead", "daeb", "bbbb", "e"], 3), ("fed", ["def", "fed"], 0)]  # fmt: skip


def _task(path: str) -> dict:
    return {
        "task": "espert_mc_probe",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": path}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{gold}}",
        "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}],
    }


def test_lm_eval_scores_espert_models_as_espert_does(tmp_path):
    base = build_tiny_model(str(tmp_path / "base"), seed=0)
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "gold": g}) + "\n" for q, c, g in ITEMS))
    run = tmp_path / "run"  # an ES run directory: lm-eval gets its export
    (run / "export").mkdir(parents=True)
    (run / "config.yaml").write_text("config: {}\n")
    for f in os.listdir(base):
        shutil.copy(os.path.join(base, f), run / "export" / f)
    from espert.evaluators import load_model

    model, tok = load_model(base)
    tok.padding_side = "right"
    mine = score_mc(model, tok, load_mc(str(data)))
    for pretrained in (base, str(run)):
        res = lm_eval.simple_evaluate(
            model="espert", model_args=f"pretrained={pretrained}", tasks=[_task(str(data))], bootstrap_iters=0
        )["results"]["espert_mc_probe"]
        assert res["acc,none"] == pytest.approx(mine["acc"]) and res["acc_norm,none"] == pytest.approx(mine["acc_norm"])
    # a RandOpt ensemble's member: the model lm-eval scores is base + sigma * eps(seed), made by the ops
    cfg = ESConfig(method="randopt", population=4, randopt_top_k=2)
    member = {"rank": 1, "k": 0, "seed": 12345, "sigma": 0.05, "reward": 1.0}
    ens = tmp_path / "randopt"
    ens.mkdir()
    (ens / "ensemble.json").write_text(json.dumps({"method": "randopt", "base_model": base, "members": [member],
                                                   "config": cfg.to_dict()}))  # fmt: skip
    lm = espert.eval.lmeval.EspertLM(pretrained=str(ens), member=1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            ops.perturb_(p.data, 12345, param_key(name), 0.05)
    reqs = [("Question: abc\nAnswer:", " abc"), ("Question: hi\nAnswer:", " hi")]
    want = loglikelihoods(model, tok, reqs)
    got = lm.loglikelihood([type("R", (), {"args": r})() for r in reqs])
    assert got == want
