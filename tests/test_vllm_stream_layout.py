"""Chunked center streaming over tensor-parallel layouts, without vLLM.

Two "ranks" hold the pieces a TP=2 engine holds (q/k/v and gate/up row blocks, o_proj/down_proj
column blocks, k/v replicated on both ranks, a whole norm, a 1-D bias block); a stand-in for
``collective_rpc`` answers ``es_center_layout`` / ``es_center_chunk`` exactly as the worker does
(same chunk plan).  ``write_center`` must give the bytes of ``espert.runs.write_safetensors`` of
the logical tensors for every chunk size (including chunks smaller than a row), and
``pull_center`` the logical tensors, refusing replicated pieces that disagree.
"""

import pytest
import torch

from espert.ops import Block
from espert.runs import write_safetensors
from espert.vllm.params import block_to_tuple
from espert.vllm.stream import chunk_plan, pull_center, write_center


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
