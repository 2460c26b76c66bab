"""Tests for espert.eval.analyze: drift statistics, thresholded export, input checks."""

import argparse
import hashlib
import json
import os
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))
from tiny_model import build_tiny_model  # noqa: E402

import espert.eval.analyze as an  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny base model and a perturbed copy with a spread of update magnitudes."""
    root = tmp_path_factory.mktemp("analyze")
    base = build_tiny_model(str(root / "base"))
    ckpt = str(root / "ckpt")
    shutil.copytree(base, ckpt)
    sd = load_file(os.path.join(base, "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    new = {}
    for i, (name, t) in enumerate(sorted(sd.items())):
        if "norm" in name:
            new[name] = t.clone()  # norms untouched -> zero drift
            continue
        scale = 10.0 ** (-(i % 5) - 2)  # 1e-2 ... 1e-6, varies per tensor
        d = torch.randn(t.shape, generator=g) * scale
        d[torch.rand(t.shape, generator=g) < 0.3] = 0.0  # ~30% of weights unchanged
        new[name] = (t + d).to(t.dtype)
    save_file(new, os.path.join(ckpt, "model.safetensors"), metadata={"format": "pt"})
    return base, ckpt, sd, new


def _digest(d):
    h = hashlib.sha256()
    for f in sorted(os.listdir(d)):
        h.update(f.encode())
        h.update(open(os.path.join(d, f), "rb").read())
    return h.hexdigest()


def test_param_groups():
    cases = {
        "model.embed_tokens.weight": "embeddings",
        "model.layers.0.self_attn.q_proj.weight": "attn_q",
        "model.layers.0.self_attn.k_proj.bias": "attn_k",
        "model.layers.0.self_attn.v_proj.weight": "attn_v",
        "model.layers.0.self_attn.o_proj.weight": "attn_o",
        "model.layers.0.self_attn.q_norm.weight": "norm",
        "model.layers.0.mlp.gate_proj.weight": "mlp",
        "model.layers.1.mlp.down_proj.weight": "mlp",
        "model.layers.1.input_layernorm.weight": "norm",
        "model.norm.weight": "norm",
        "lm_head.weight": "lm_head",
        "transformer.wte.weight": "embeddings",
        "transformer.h.0.attn.c_attn.weight": "attn_qkv",
        "transformer.h.0.attn.c_proj.weight": "attn_o",
        "transformer.h.0.mlp.c_fc.weight": "mlp",
        "transformer.h.0.ln_1.weight": "norm",
        "score.weight": "other",
        "value_head.scalar": "other",
    }
    for name, group in cases.items():
        assert an.param_group(name) == group, name


def _direct(sd, new, names):
    num = sum(float(((new[n].double() - sd[n].double()) ** 2).sum()) for n in names)
    den = sum(float((sd[n].double() ** 2).sum()) for n in names)
    return (num / den) ** 0.5


@pytest.mark.parametrize("chunk", [1 << 24, 1000])
def test_drift_matches_direct_torch(models, monkeypatch, chunk):
    base, ckpt, sd, new = models
    monkeypatch.setattr(an, "CHUNK_ELEMENTS", chunk)  # 1000 forces the row-chunked path
    taus = [1e-6, 1e-4, 1e-2]
    res = an.compute_drift(base, ckpt, taus)
    names = list(sd)
    assert res["overall"]["rel_l2"] == pytest.approx(_direct(sd, new, names), rel=1e-9)
    for group in ("attn_q", "mlp", "embeddings", "lm_head"):
        members = [n for n in names if an.param_group(n) == group]
        assert members
        assert res["groups"][group]["rel_l2"] == pytest.approx(_direct(sd, new, members), rel=1e-9)
        assert res["groups"][group]["numel"] == sum(sd[n].numel() for n in members)
    assert res["groups"]["norm"]["rel_l2"] == 0.0 and res["groups"]["norm"]["n_changed"] == 0
    deltas = torch.cat([(new[n].double() - sd[n].double()).abs().flatten() for n in names])
    changed = deltas[deltas > 0]
    assert res["overall"]["n_changed"] == changed.numel()
    assert res["overall"]["max_abs_update"] == pytest.approx(float(changed.max()))
    for t in taus:
        assert res["update_magnitudes"]["share_le_tau"][repr(t)] == pytest.approx(
            float((changed <= t).double().mean()), abs=1e-12
        )
    assert sum(res["update_magnitudes"]["histogram"]["counts"]) == changed.numel()
    assert len(res["per_tensor"]) == len(names)


def test_export_thresholded_reloads_with_transformers(models, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base, ckpt, sd, new = models
    before = (_digest(base), _digest(ckpt))
    tau = 1e-4
    out = tmp_path / "export"
    info = an.export_thresholded(base, ckpt, str(out), tau)
    assert (_digest(base), _digest(ckpt)) == before  # inputs untouched
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= set(os.listdir(out))
    model = AutoModelForCausalLM.from_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(out))
    exported = load_file(str(out / "model.safetensors"))
    n_reset = n_changed = 0
    state = model.state_dict()
    for name, b in sd.items():
        c = new[name]
        e = exported[name]
        assert e.dtype == c.dtype and e.shape == c.shape
        assert torch.equal(state[name], e)
        d = (c.double() - b.double()).abs()
        small = d <= tau
        assert torch.equal(e[small], b[small])  # small updates reset to base
        assert torch.equal(e[~small], c[~small])  # large updates kept
        n_reset += int((small & (d > 0)).sum())
        n_changed += int((d > 0).sum())
    assert info["n_reset"] == n_reset > 0 and info["n_changed"] == n_changed and info["n_kept"] > 0
    # drift of the export = only the kept updates
    res = an.compute_drift(base, str(out), [tau])
    assert res["update_magnitudes"]["share_le_tau"][repr(tau)] == 0.0


def test_export_refuses_unsafe_outputs(models, tmp_path):
    base, ckpt, _, _ = models
    with pytest.raises(ValueError, match="input location"):
        an.export_thresholded(base, ckpt, ckpt, 1e-3, force=True)
    with pytest.raises(ValueError, match="input location"):
        an.export_thresholded(base, ckpt, os.path.join(base, "sub"), 1e-3, force=True)
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        an.export_thresholded(base, ckpt, str(out), 1e-3)
    (out / "stale-00002.safetensors").write_bytes(b"old")
    an.export_thresholded(base, ckpt, str(out), 1e-3, force=True)
    assert (out / "keep.txt").exists() and not (out / "stale-00002.safetensors").exists()
    with pytest.raises(ValueError, match="tau"):
        an.export_thresholded(base, ckpt, str(tmp_path / "x"), float("nan"))


def test_mismatched_checkpoints_name_the_tensor(models, tmp_path):
    base, _, sd, _ = models
    bad = dict(sd)
    name = "model.layers.0.self_attn.q_proj.weight"
    bad[name] = torch.zeros(3, 3)
    save_file(bad, str(tmp_path / "shape.safetensors"))
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + ".*shape"):
        an.compute_drift(base, str(tmp_path / "shape.safetensors"))
    bad = dict(sd)
    bad.pop(name)
    bad["extra.weight"] = torch.zeros(2)
    save_file(bad, str(tmp_path / "names.safetensors"))
    with pytest.raises(ValueError, match="extra.weight"):
        an.compute_drift(base, str(tmp_path / "names.safetensors"))
    with pytest.raises(FileNotFoundError, match="nowhere"):
        an.compute_drift(base, str(tmp_path / "nowhere"))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin"):
        an.compute_drift(base, str(tmp_path / "bin"))


def test_bare_safetensors_file_and_cli(models, tmp_path, capsys):
    base, ckpt, _, _ = models
    bare = tmp_path / "step10.safetensors"
    shutil.copyfile(os.path.join(ckpt, "model.safetensors"), bare)
    parser = argparse.ArgumentParser()
    an.add_arguments(parser)
    args = parser.parse_args(
        [
            "--base",
            base,
            "--ckpt",
            f"es={bare}",
            "--json",
            str(tmp_path / "a.json"),
            "--plot-dir",
            str(tmp_path / "plots"),
            "--export",
            str(tmp_path / "exp"),
            "--threshold",
            "1e-5",
            "--taus",
            "1e-5",
            "1e-3",
        ]
    )
    assert an.run_analyze(args) == 0
    out = capsys.readouterr().out
    assert "es: rel L2 drift" in out and "exported es" in out
    rep = json.load(open(tmp_path / "a.json"))
    assert rep["checkpoints"]["es"]["update_magnitudes"]["taus"] == [1e-5, 1e-3]
    assert rep["export"]["n_reset"] > 0
    # a bare file export takes config/tokenizer from the base dir and loads
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= set(os.listdir(tmp_path / "exp"))
    for png in ("drift_groups.png", "update_hist.png"):
        assert (tmp_path / "plots" / png).read_bytes()[:4] == b"\x89PNG"
    # exporting again into the now non-empty dir fails cleanly without --force
    assert an.run_analyze(args) == 2
    assert "--force" in capsys.readouterr().err
