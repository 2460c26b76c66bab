"""Chunked center streaming over tensor-parallel layouts, without vLLM.

Two "ranks" hold the pieces a TP=2 engine holds (q/k/v and gate/up row blocks, o_proj/down_proj
column blocks, k/v replicated on both ranks, a whole norm, a 1-D bias block); a stand-in for
``collective_rpc`` answers ``es_center_layout`` / ``es_center_chunk`` exactly as the worker does
(same chunk plan).  ``write_center`` must give the bytes of ``espert.runs.write_safetensors`` of
the logical tensors for every chunk size (including chunks smaller than a row), and
``pull_center`` the logical tensors, refusing replicated pieces that disagree.
"""

import os

import pytest
import torch

from espert.ops import Block
from espert.runs import write_safetensors
from espert.vllm.driver.stream import pull_center, write_center
from espert.vllm.wire import block_to_tuple, chunk_plan


def logical_state():
    g = torch.Generator().manual_seed(0)
    return {
        "q.weight": torch.randn(8, 6, generator=g),
        "k.weight": torch.randn(4, 6, generator=g),
        "o.weight": torch.randn(6, 8, generator=g),
        "down.bias": torch.randn(10, generator=g),
        "norm.weight": torch.randn(6, generator=g),
        "emb.weight": torch.randn(5, 6, generator=g).to(torch.bfloat16),
    }


def rank_pieces(state, rank):
    """(name, local tensor, Block) as a TP=2 rank holds them."""
    q, k, o = state["q.weight"], state["k.weight"], state["o.weight"]
    return [
        ("q.weight", q[4 * rank : 4 * rank + 4], Block(4 * rank, 0, 8, 6)),
        ("k.weight", k, None),  # replicated on both ranks
        ("o.weight", o[:, 4 * rank : 4 * rank + 4], Block(0, 4 * rank, 6, 8)),  # row-parallel: a column block
        ("down.bias", state["down.bias"][5 * rank : 5 * rank + 5], Block(0, 5 * rank, 1, 10)),
        ("norm.weight", state["norm.weight"], None),
        ("emb.weight", state["emb.weight"][3 * rank : min(5, 3 * rank + 3)], Block(3 * rank, 0, 5, 6)),
    ]


def fake_rpc(ranks):
    def rpc(method, *args):
        out = []
        for pieces in ranks:
            if method == "es_center_layout":
                out.append(
                    [(n, list(t.shape), block_to_tuple(b), str(t.dtype).removeprefix("torch.")) for n, t, b in pieces]
                )
                continue
            k, cb = args
            ts = [t.contiguous() for _, t, _ in pieces]
            got = None
            for j, (i, a, b) in enumerate(chunk_plan([t.numel() for t in ts], [t.element_size() for t in ts], cb)):
                if j == k:
                    flat = ts[i].reshape(-1)[a:b]
                    got = (
                        i,
                        a,
                        b,
                        flat.view(torch.int32 if flat.element_size() == 4 else torch.int16).numpy().tobytes(),
                    )
                    break
            out.append(got)
        return out

    return rpc


@pytest.mark.parametrize("chunk_bytes", [4, 12, 40, 1 << 20])
def test_tp_layouts_stream_to_the_same_bytes(tmp_path, chunk_bytes):
    state = logical_state()
    rpc = fake_rpc([rank_pieces(state, 0), rank_pieces(state, 1)])
    meta = {"format": "pt", "iteration": "7"}
    sha = write_center(rpc, str(tmp_path / "s.safetensors"), meta, chunk_bytes)
    assert sha == write_safetensors(str(tmp_path / "r.safetensors"), state, meta)
    assert (tmp_path / "s.safetensors").read_bytes() == (tmp_path / "r.safetensors").read_bytes()
    got = pull_center(rpc, chunk_bytes)
    assert sorted(got) == sorted(state)
    for k, v in state.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_replicated_pieces_must_agree():
    state = logical_state()
    r1 = rank_pieces(state, 1)
    r1[1] = ("k.weight", state["k.weight"] + 1, None)
    with pytest.raises(ValueError, match="replicated pieces differ"):
        pull_center(fake_rpc([rank_pieces(state, 0), r1]), 64)


def test_uncovered_elements_are_an_error():
    state = logical_state()
    with pytest.raises(ValueError, match="not covered"):
        pull_center(fake_rpc([rank_pieces(state, 0)]), 64)  # rank 1 missing
    with pytest.raises(ValueError, match="chunk_bytes"):
        list(chunk_plan([4], [4], 0))


def base_model(tmp_path, state):
    """A two-shard 'model directory' holding the logical tensors in other dtypes (bf16, f16, int8 codes),
    a tensor that is not in the center, and a config file."""
    from safetensors.torch import save_file

    d = tmp_path / "base"
    d.mkdir()
    g = torch.Generator().manual_seed(1)
    s1 = {
        "q.weight": state["q.weight"].to(torch.bfloat16),
        "k.weight": state["k.weight"].to(torch.float16),
        "rotary.inv_freq": torch.randn(7, generator=g),  # not a center tensor: copied as it is
    }
    s2 = {
        "o.weight": state["o.weight"],
        "down.bias": state["down.bias"].to(torch.bfloat16),
        "norm.weight": torch.zeros(6, dtype=torch.int8),  # a W8A8-style code tensor: the center rounds into it
        "emb.weight": state["emb.weight"],
    }
    save_file(s1, str(d / "model-00001-of-00002.safetensors"), {"format": "pt"})
    save_file(s2, str(d / "model-00002-of-00002.safetensors"), {"format": "pt", "note": "second"})
    (d / "config.json").write_text('{"model_type": "test"}')
    return str(d)


def files(d):
    return {f: open(os.path.join(d, f), "rb").read() for f in sorted(os.listdir(d))}


@pytest.mark.parametrize("chunk_bytes", [12, 40, 1 << 20])
def test_checkpoint_and_export_stream_to_the_bytes_of_the_dicts(tmp_path, chunk_bytes):
    """save_center and export_model from a CenterStream (TP=2, optimizer slots in the layout, chunks
    smaller than a row) write the files the full dicts give; the export casts chunk by chunk and
    leaves the optimizer slots out."""
    from espert import runs
    from espert.vllm.driver.stream import CenterStream

    state = logical_state()
    state["norm.weight"] = state["norm.weight"] * 100  # code units: rounding and clamping to int8 matter
    slot = {"optim.m/q.weight": torch.randn(8, 6, generator=torch.Generator().manual_seed(2))}
    ranks = [rank_pieces(state, r) for r in (0, 1)]
    ranks[0].append(("optim.m/q.weight", slot["optim.m/q.weight"][:4], Block(0, 0, 8, 6)))
    ranks[1].append(("optim.m/q.weight", slot["optim.m/q.weight"][4:], Block(4, 0, 8, 6)))
    rpc = fake_rpc(ranks)
    base = base_model(tmp_path, state)
    full = {**state, **slot}

    a = runs.save_center(str(tmp_path / "a.safetensors"), full, 4)
    b = runs.save_center(str(tmp_path / "b.safetensors"), CenterStream(rpc, chunk_bytes), 4)
    assert a == b and (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()

    runs.export_model(state, base, str(tmp_path / "ea"), iteration=4)
    runs.export_model(CenterStream(rpc, chunk_bytes), base, str(tmp_path / "eb"), iteration=4)
    ea, eb = files(tmp_path / "ea"), files(tmp_path / "eb")
    assert ea == eb and "config.json" in ea and len([f for f in ea if f.endswith(".safetensors")]) == 2

    from safetensors.torch import load_file

    got = {}
    for f in ea:
        if f.endswith(".safetensors"):
            got.update(load_file(str(tmp_path / "eb" / f)))
    assert "optim.m/q.weight" not in got
    assert got["q.weight"].dtype == torch.bfloat16 and torch.equal(
        got["q.weight"], state["q.weight"].to(torch.bfloat16)
    )
    assert torch.equal(got["norm.weight"], state["norm.weight"].round().clamp(-128, 127).to(torch.int8))
    assert torch.equal(
        got["rotary.inv_freq"], load_file(os.path.join(base, "model-00001-of-00002.safetensors"))["rotary.inv_freq"]
    )


def test_export_refuses_unknown_names_and_shapes_before_writing(tmp_path):
    from espert import runs
    from espert.vllm.driver.stream import CenterStream

    state = logical_state()
    base = base_model(tmp_path, state)
    out = str(tmp_path / "out")
    with pytest.raises(ValueError, match=r"no tensors named \['extra.weight'\]"):
        runs.export_model({**state, "extra.weight": torch.zeros(2)}, base, out)
    ranks = [rank_pieces(state, r) for r in (0, 1)]
    ranks[0][4] = ("norm.weight", torch.zeros(3), None)
    ranks[1][4] = ("norm.weight", torch.zeros(3), None)
    with pytest.raises(ValueError, match=r"center norm.weight has shape \(3,\), base has \(6,\)"):
        runs.export_model(CenterStream(fake_rpc(ranks), 64), base, out)
    assert not os.path.exists(out) and os.listdir(tmp_path) == ["base"]


def test_a_stream_that_misses_elements_writes_no_checkpoint(tmp_path):
    """A source whose chunks leave part of a tensor unwritten (here: rank 1 never answers) is an error
    naming the tensor, and the old checkpoint stays: zeros are never saved as weights."""
    from espert import runs
    from espert.vllm.driver.stream import CenterStream

    state = logical_state()
    path = str(tmp_path / "center.safetensors")
    sha = runs.save_center(path, state, 1)
    with pytest.raises(ValueError, match=r"q.weight received 96 of its 192 bytes \(the chunks do not cover it\)"):
        runs.save_center(path, CenterStream(fake_rpc([rank_pieces(state, 0)]), 40), 2)
    assert runs.sha256_file(path) == sha and os.listdir(tmp_path) == ["center.safetensors"]
