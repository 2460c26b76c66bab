"""The tiny model and its character tokenizer: local, deterministic, standard HF format."""

import json
import os

import torch

from espert.tiny import SPECIAL_TOKENS, TinySpec, build_tiny_model, build_tokenizer


def test_tokenizer_is_character_level():
    tok = build_tokenizer()
    assert len(tok) == len(SPECIAL_TOKENS) + len("abcdef>")
    assert [tok.convert_ids_to_tokens(i) for i in range(4)] == list(SPECIAL_TOKENS)
    ids = tok("cafe>").input_ids
    assert ids[0] == tok.bos_token_id and len(ids) == 6
    assert tok.decode(ids, skip_special_tokens=True) == "cafe>"
    assert tok("xyz").input_ids[1:] == [tok.unk_token_id] * 3
    batch = tok(["ab>", "abcde>"], padding=True, return_tensors="pt")
    assert tok.padding_side == "left" and batch.input_ids[0, 0].item() == tok.pad_token_id
    assert batch.attention_mask[0].tolist() == [0, 0, 0, 1, 1, 1, 1]


def test_tiny_model_is_deterministic_and_loads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = build_tiny_model(str(tmp_path / "a"), seed=3)
    b = build_tiny_model(str(tmp_path / "b"), seed=3)
    c = build_tiny_model(str(tmp_path / "c"), seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.mlp.up_proj.weight"], sc["model.layers.0.mlp.up_proj.weight"])
    d = str(tmp_path / "a")
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.exists(os.path.join(d, f)), f
    cfg = json.load(open(os.path.join(d, "config.json")))
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["head_dim"] == 32 and cfg["num_hidden_layers"] == 2
    m = AutoModelForCausalLM.from_pretrained(d)
    assert m.dtype == torch.float32
    assert all(torch.equal(m.state_dict()[k], sa[k]) for k in sa)
    tok = AutoTokenizer.from_pretrained(d)
    enc = tok(["abc>"], return_tensors="pt")
    out = m.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[0] == 1 and out.shape[1] <= enc.input_ids.shape[1] + 4
    assert sum(p.numel() for p in m.parameters()) < 100_000


def test_spec_changes_shape(tmp_path):
    m = build_tiny_model(
        str(tmp_path / "m"),
        spec=TinySpec(hidden_size=32, num_attention_heads=1, intermediate_size=48, num_hidden_layers=1),
    )
    assert m.config.hidden_size == 32 and m.config.num_hidden_layers == 1


def test_a_run_sweeps_the_tiny_model_width(tmp_path, capsys):
    """Before: every `model: tiny` run built the same 84k-parameter model, so a sweep had no
    model-size axis.  Now tiny_hidden_size builds 21k / 84k / 331k-parameter bases (64: the default,
    the main job's model unchanged)."""
    import pytest

    from espert.cli import main
    from espert.config import ESConfig
    from espert.runs.run import build_tiny_base
    from espert.tiny import tiny_spec

    assert tiny_spec(64) == TinySpec()
    sizes = {}
    for h in (32, 64, 128):
        build_tiny_base(str(tmp_path / str(h)), ESConfig(tiny_hidden_size=h, pretrain_steps=0))
        cfg = json.load(open(tmp_path / str(h) / "config.json"))
        assert cfg["hidden_size"] == h and cfg["intermediate_size"] == 2 * h and cfg["num_attention_heads"] == h // 32
        sizes[h] = sum(p.numel() for p in build_tiny_model(str(tmp_path / "x"), spec=tiny_spec(h)).parameters())
    assert sizes == {32: 21344, 64: 83648, 128: 331136}
    with pytest.raises(ValueError, match="tiny_hidden_size must be a positive multiple of 32, got 48"):
        ESConfig(tiny_hidden_size=48)
    assert main(["train", "--tiny-hidden-size", "40", "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "tiny_hidden_size must be a positive multiple of 32, got 40" in err and "Traceback" not in err
