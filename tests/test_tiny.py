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
