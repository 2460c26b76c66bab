"""espert forgetting: the log-likelihood scorer against a direct torch computation, MC files in lm-eval's and
es-awd's layouts (JSONL and parquet), KL(base ‖ model) against a direct computation, the update geometry
on known updates, and the one-command report."""

import json
import math
import os
import sys

import pytest
import torch

from espert.eval import forgetting as F
from espert.eval.mc import MCItem, load_mc, loglikelihoods, score_mc

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "fixtures"))
from tiny_model import build_tiny_model  # noqa: E402

LAYOUTS = os.path.join(HERE, "fixtures", "mc_layouts.jsonl")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from espert.evaluators import load_model

    d = build_tiny_model(str(tmp_path_factory.mktemp("forget") / "base"), seed=0)
    model, tok = load_model(d)
    tok.padding_side = "right"
    return d, model, tok


def _direct_ll(model, tok, context: str, continuation: str) -> float:
    """Σ log p(token | all tokens before it), one unbatched forward per continuation token."""
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    n_ctx = len(tok(context, add_special_tokens=False)["input_ids"])
    total = 0.0
    for i in range(n_ctx, len(whole)):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([whole[:i]])).logits[0, -1].double()
        total += float(logits.log_softmax(-1)[whole[i]])
    return total


def test_loglikelihood_agrees_with_a_direct_torch_computation(tiny):
    _, model, tok = tiny
    reqs = [("abc>", " abc"), ("hello world>", " dlrow"), ("x", " a much longer continuation here"), ("ab ", "ba")]
    got = loglikelihoods(model, tok, reqs, batch_size=3)  # padded batches of unequal length
    for (ctx, cont), (ll, _) in zip(reqs, got):
        if ctx.endswith(" "):  # lm-eval moves the context's trailing space to the continuation
            ctx, cont = ctx[:-1], " " + cont
        assert ll == pytest.approx(_direct_ll(model, tok, ctx, cont), abs=1e-4), (ctx, cont)
    items = [MCItem("abc", ("abc", "xyz", "q"), 0), MCItem("hi", ("ih", "hi"), 1)]
    res = score_mc(model, tok, items)
    for item, per in zip(items, res["per_item"]):
        direct = [_direct_ll(model, tok, f"Question: {item.question}\nAnswer:", " " + c) for c in item.choices]
        assert per["ll"] == pytest.approx(direct, abs=1e-4)
        assert per["pred"] == direct.index(max(direct))
    assert res["acc"] == sum(p["pred"] == p["gold"] for p in res["per_item"]) / 2


def test_mc_files_in_lm_eval_and_es_awd_layouts(tmp_path):
    items = load_mc(LAYOUTS)
    assert [it.gold for it in items] == [1, 0, 0, 1, 1]
    assert items[0].choices[1] == "carbon dioxide" and items[2].choices == ("put a wedge under it.", "paint it blue.")
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    rows = [json.loads(line) for line in open(LAYOUTS)][1:2]  # hellaswag's layout, as es-awd's parquet holds it
    path = str(tmp_path / "hs.parquet")
    pd.DataFrame(rows).to_parquet(path)
    assert load_mc(path) == [items[1]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "choices": ["a", "b"], "label": 5}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: gold answer 5 is not one of the 2 choices"):
        load_mc(str(bad))
    bad.write_text('{"question": "q", "label": 0}\n')
    with pytest.raises(ValueError, match="needs a question .* and choices"):
        load_mc(str(bad))


def _perturbed(model, scale=0.05, seed=1):
    import copy

    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return m


def test_token_kl_against_a_direct_computation(tiny):
    _, model, tok = tiny
    seqs = F.probe_sequences(model, tok, ["abc>", "hello>", "x"], tokens=5, chat_template=False)
    assert F.token_kl(model, model, seqs)["mean"] == 0.0
    other = _perturbed(model)
    res = F.token_kl(model, other, seqs, batch_size=2)
    per_prompt = []
    for p, c in seqs:
        ids = torch.tensor([p + c])
        with torch.no_grad():
            lb = model(input_ids=ids).logits[0].double().log_softmax(-1)
            lm = other(input_ids=ids).logits[0].double().log_softmax(-1)
        per_prompt.append(
            [float((lb[j].exp() * (lb[j] - lm[j])).sum()) for j in range(len(p) - 1, len(p) + len(c) - 1)]
        )
    flat = [x for k in per_prompt for x in k]
    assert res["n_tokens"] == len(flat) and res["mean"] == pytest.approx(sum(flat) / len(flat), rel=1e-6)
    assert res["per_position"][0] == pytest.approx(sum(k[0] for k in per_prompt) / len(per_prompt), rel=1e-6)
    assert res["mean"] > 0


def test_update_geometry_on_known_updates(tiny, tmp_path):
    """A rank-2 update of one matrix: effective rank below 2 (its two singular values are unequal) and
    stable rank at most 2; the moved share and the per-layer norm are what was written."""
    d, model, tok = tiny
    import copy

    m = copy.deepcopy(model)
    name = "model.layers.1.self_attn.q_proj.weight"
    w = m.get_parameter(name)
    u, v = torch.randn(w.shape[0], 2), torch.randn(2, w.shape[1])
    delta = (u * torch.tensor([1.0, 0.5])) @ v * 1e-2
    with torch.no_grad():
        w.add_(delta)
    m.save_pretrained(str(tmp_path / "m"))
    tok.save_pretrained(str(tmp_path / "m"))
    g = F.update_geometry(d, str(tmp_path / "m"), threshold=1e-9, n_rank=4)
    r = g["rank"][name]
    assert 1.0 < r["effective_rank"] < 2.0 and r["stable_rank"] <= 2.0 + 1e-9
    assert g["rank"]["model.layers.0.self_attn.q_proj.weight"]["effective_rank"] == 0.0
    moved = int(((w.detach() - model.get_parameter(name)).abs() > 1e-9).sum())
    n = sum(p.numel() for p in model.parameters())
    assert g["frac_beyond_threshold"] == pytest.approx(moved / n)
    stored = (w.detach() - model.get_parameter(name)).double()
    assert g["per_layer_l2"]["1"] == pytest.approx(float(stored.norm()), rel=1e-6) and g["per_layer_l2"]["0"] == 0.0
    assert math.isclose(F.effective_rank(torch.eye(3))["effective_rank"], 3.0)


def test_one_command_writes_the_report(tiny, tmp_path, capsys):
    from espert.cli import main

    d, model, tok = tiny
    other = _perturbed(model, 0.02)
    other.save_pretrained(str(tmp_path / "es"))
    tok.save_pretrained(str(tmp_path / "es"))
    out = tmp_path / "out"
    argv = ["forgetting", "--models", f"base={d}", f"es={tmp_path / 'es'}", "--task", "copy", "arithmetic",
            "--mc", "multiplication_mc", f"layouts={LAYOUTS}", "--limit", "4", "--max-new-tokens", "4",
            "--probe-prompts", "5", "--probe-tokens", "4", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    doc = json.load(open(out / "forgetting.json"))
    assert set(doc["generation"]["tasks"]) == {"copy", "arithmetic"}
    assert set(doc["mc"]) == {"multiplication_mc", "layouts"} and doc["mc"]["layouts"]["es"]["n"] == 4
    assert doc["kl"]["base"]["mean"] == 0.0 and doc["kl"]["es"]["mean"] > 0 and doc["probe"]["prompts"] == 5
    assert set(doc["geometry"]) == {"es"} and doc["geometry"]["es"]["rel_l2"] > 0
    text = open(out / "forgetting.md").read()
    assert "## Update geometry" in text and "KL(base ‖ model)" in text and "multiplication_mc (n=4)" in text
    assert os.path.getsize(out / "forgetting.png") > 0
    capsys.readouterr()
    assert main(["forgetting", "--models", f"base={d}", "--out", str(out)]) == 2
    assert "give --task and/or --mc" in capsys.readouterr().err
