"""Logical noise for vLLM layouts, without vLLM: shards built by hand as vLLM's loaders build them.

The same perturbation applied (a) to the full logical (checkpoint) tensors and (b) to each rank's
fused, sharded local tensors through the ParamViews of espert.vllm.engine.params must agree bit for bit,
for TP = 1, 2, 4, with k/v heads replicated when tp > kv heads (identical noise on every replica).
"""

import pytest
import torch

from espert.center import CenterStore
from espert.ops import Block, perturb_
from espert.params import ParamView
from espert.update import Update
from espert.vllm.engine.params import LayoutError, Piece, linear_pieces, piece_views, vocab_pieces
from espert.vllm.wire import assemble, block_to_tuple, pack_tensor, split_logical, unpack_tensor

H, HD, NH, NKV, I, V = 64, 16, 4, 2, 96, 37  # hidden, head dim, heads, kv heads, intermediate, vocab
P = "model.layers.0"


def logical_model(gen):
    w = lambda *s: torch.randn(*s, generator=gen) * 0.05  # noqa: E731
    return {
        f"{P}.self_attn.q_proj.weight": w(NH * HD, H),
        f"{P}.self_attn.k_proj.weight": w(NKV * HD, H),
        f"{P}.self_attn.v_proj.weight": w(NKV * HD, H),
        f"{P}.self_attn.q_proj.bias": w(NH * HD),
        f"{P}.self_attn.k_proj.bias": w(NKV * HD),
        f"{P}.self_attn.v_proj.bias": w(NKV * HD),
        f"{P}.self_attn.o_proj.weight": w(H, NH * HD),
        f"{P}.mlp.gate_proj.weight": w(I, H),
        f"{P}.mlp.up_proj.weight": w(I, H),
        f"{P}.mlp.down_proj.weight": w(H, I),
        f"{P}.mlp.down_proj.bias": w(H),
        "model.embed_tokens.weight": w(V, H),
        f"{P}.input_layernorm.weight": w(H),
    }


def vllm_shards(full, rank, tp):
    """Each rank's live tensors, built like vLLM's weight loaders (independently of espert.vllm.engine.params)."""
    g = lambda n: full[n]  # noqa: E731
    a, m = f"{P}.self_attn.", f"{P}.mlp."
    nh = NH // tp
    if tp >= NKV:
        nkv, kv_shard = 1, rank // (tp // NKV)
    else:
        nkv, kv_shard = NKV // tp, rank
    qs = slice(rank * nh * HD, (rank + 1) * nh * HD)
    ks = slice(kv_shard * nkv * HD, (kv_shard + 1) * nkv * HD)
    ip = I // tp
    vp = -(-V // (64 * tp)) * 64  # padded vocab per rank (pad to 64 then split)
    v0, v1 = min(V, rank * vp), min(V, (rank + 1) * vp)
    emb = torch.zeros(vp, H)
    emb[: v1 - v0] = g("model.embed_tokens.weight")[v0:v1]
    return {
        a + "qkv_proj.weight": torch.cat(
            [g(a + "q_proj.weight")[qs], g(a + "k_proj.weight")[ks], g(a + "v_proj.weight")[ks]]
        ).contiguous(),
        a + "qkv_proj.bias": torch.cat(
            [g(a + "q_proj.bias")[qs], g(a + "k_proj.bias")[ks], g(a + "v_proj.bias")[ks]]
        ).contiguous(),
        a + "o_proj.weight": g(a + "o_proj.weight")[:, rank * NH * HD // tp : (rank + 1) * NH * HD // tp].contiguous(),
        m + "gate_up_proj.weight": torch.cat(
            [
                g(m + "gate_proj.weight")[rank * ip : (rank + 1) * ip],
                g(m + "up_proj.weight")[rank * ip : (rank + 1) * ip],
            ]
        ).contiguous(),
        m + "down_proj.weight": g(m + "down_proj.weight")[:, rank * ip : (rank + 1) * ip].contiguous(),
        m + "down_proj.bias": g(m + "down_proj.bias").clone(),
        "model.embed_tokens.weight": emb,
        f"{P}.input_layernorm.weight": g(f"{P}.input_layernorm.weight").clone(),
    }, (v0, v1)


def rank_views(live, rank, tp, vocab_range):
    a, m = f"{P}.self_attn.", f"{P}.mlp."
    qkv = dict(
        num_heads=NH // tp,
        num_kv_heads=max(1, NKV // tp),
        total_num_heads=NH,
        total_num_kv_heads=NKV,
        head_size=HD,
        num_kv_head_replicas=max(1, tp // NKV),
        tp_rank=rank,
        tp_size=tp,
    )
    names = {k: [a + f"{x}_proj.{k}" for x in "qkv"] for k in ("weight", "bias")}
    views = []
    for leaf in ("weight", "bias"):
        n = a + f"qkv_proj.{leaf}"
        views += piece_views(live[n], linear_pieces("qkv", n, live[n].shape, logical_names=names[leaf], **qkv))
    n = a + "o_proj.weight"
    views += piece_views(live[n], linear_pieces("row", n, live[n].shape, tp_rank=rank, tp_size=tp))
    n = m + "gate_up_proj.weight"
    views += piece_views(
        live[n],
        linear_pieces(
            "merged",
            n,
            live[n].shape,
            logical_names=[m + "gate_proj.weight", m + "up_proj.weight"],
            output_sizes=[I, I],
            tp_rank=rank,
            tp_size=tp,
        ),
    )
    for n in (m + "down_proj.weight", m + "down_proj.bias"):
        views += piece_views(live[n], linear_pieces("row", n, live[n].shape, tp_rank=rank, tp_size=tp))
    n = "model.embed_tokens.weight"
    views += piece_views(
        live[n],
        vocab_pieces(n, live[n].shape, org_vocab_start=vocab_range[0], org_vocab_end=vocab_range[1], org_vocab_size=V),
    )
    n = f"{P}.input_layernorm.weight"
    views += piece_views(live[n], linear_pieces("replicated", n, live[n].shape))
    return views


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_sharded_fused_noise_equals_logical_noise(tp):
    gen = torch.Generator().manual_seed(tp)
    full = logical_model(gen)
    ref = {k: v.clone() for k, v in full.items()}
    for name, t in ref.items():
        perturb_(t, 1234, ParamView(name, t).key, 0.1, -1)
    pieces = []
    for rank in range(tp):
        live, vr = vllm_shards(full, rank, tp)
        pad_before = live["model.embed_tokens.weight"][vr[1] - vr[0] :].clone()
        views = rank_views(live, rank, tp, vr)
        store = CenterStore(views)
        store.perturb(1234, 0.1, -1)
        # the live fused/sharded tensors equal the perturbed logical tensors sharded the same way
        want, _ = vllm_shards(ref, rank, tp)
        for n, t in live.items():
            assert torch.equal(t.view(torch.int32), want[n].view(torch.int32)), (tp, rank, n)
        # vocab padding rows are not parameters: untouched
        assert torch.equal(live["model.embed_tokens.weight"][vr[1] - vr[0] :], pad_before)
        pieces.append([(v.name, pack_tensor(v.tensor), block_to_tuple(v.block)) for v in views])
        store.restore()
        for n, t in live.items():
            assert torch.equal(t, vllm_shards(full, rank, tp)[0][n])
    # reassembling every rank's pieces gives the logical tensors; replicated k/v pieces agree
    got = assemble(pieces)
    assert sorted(got) == sorted(ref)
    for n in ref:
        assert torch.equal(got[n].view(torch.int32), ref[n].view(torch.int32)), n


def test_kv_replicas_share_noise_and_split_logical_roundtrip():
    tp = 4  # 2 kv heads over 4 ranks: ranks (0, 1) and (2, 3) hold the same k/v head
    full = logical_model(torch.Generator().manual_seed(9))
    shards = [vllm_shards(full, r, tp) for r in range(tp)]
    views = [rank_views(live, r, tp, vr) for r, (live, vr) in enumerate(shards)]
    k = f"{P}.self_attn.k_proj.weight"
    for vs in views:
        CenterStore(vs).perturb(77, 0.2, 1)
    kv = [next(v for v in vs if v.name == k) for vs in views]
    assert kv[0].block == kv[1].block and kv[2].block == kv[3].block and kv[0].block != kv[2].block
    assert torch.equal(kv[0].tensor, kv[1].tensor) and torch.equal(kv[2].tensor, kv[3].tensor)
    # split_logical hands each rank exactly its blocks of a full logical state
    for r, vs in enumerate(views):
        local = split_logical(vs, full)
        for v in vs:
            assert local[v.name].shape == v.tensor.shape


@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_loop_fields_and_optimizer_pieces_equal_the_logical_center(tp):
    """What the worker does with the loop fields, without vLLM: every rank's CenterStore over its fused, sharded
    pieces (noise lowrank:2, adam, per-tensor σ scales of the whole tensors by name, decay exclusions by logical
    name) gives, reassembled from ``state_views`` (centers, optimizer slots with their parameter's block,
    ``optim.step``), the logical center's state dict bit for bit; split back, it loads into fresh ranks."""
    from espert.evaluators.torch_model import tensor_rms

    full = logical_model(torch.Generator().manual_seed(5))
    scales = {n: tensor_rms(t) for n, t in full.items()}
    loop = dict(noise="lowrank:2", optimizer="adam", no_decay=["*layernorm*", "bias"])
    logical = [ParamView(n, t.clone()) for n, t in full.items()]
    ref = CenterStore(logical, sigma_scales=[scales[v.name] for v in logical], **loop)
    shards = [vllm_shards(full, r, tp) for r in range(tp)]
    ranks = []
    for r, (live, vr) in enumerate(shards):
        views = rank_views(live, r, tp, vr)
        ranks.append(CenterStore(views, sigma_scales=[scales[v.name] for v in views], **loop))
    for t, seeds in enumerate(([3, 4, 5], [6], [7, 8]), 1):
        for c in [ref, *ranks]:
            c.update(Update(seeds, [0.02 / t] * len(seeds), 0.95, lr=0.01))
    want = ref.state_dict()
    got = assemble([[(p.name, p.tensor, block_to_tuple(p.block)) for p in c.state_views()] for c in ranks])
    assert sorted(got) == sorted(want) and got["optim.step"].tolist() == [3]
    for n, w in want.items():
        assert torch.equal(got[n], w), n
    assert not torch.equal(want[f"{P}.input_layernorm.weight"], full[f"{P}.input_layernorm.weight"])
    for r, (live, vr) in enumerate(shards):  # load: each rank takes its blocks of the logical state
        fresh = CenterStore(rank_views(live, r, tp, vr), sigma_scales=ranks[r].sigma_scales, **loop)
        fresh.load_state_dict({k: v.contiguous() for k, v in split_logical(fresh.state_views(), want).items()})
        for a, b in zip(fresh.state_views(), ranks[r].state_views()):
            assert torch.equal(a.tensor, b.tensor), a.name


def test_assemble_rejects_disagreeing_replicas_and_gaps():
    a = torch.ones(2, 4)
    blk = (0, 0, 2, 4)
    with pytest.raises(ValueError, match="replicated pieces differ"):
        assemble([[("w", a, blk)], [("w", a * 2, blk)]])
    with pytest.raises(ValueError, match="not covered"):
        assemble([[("w", a, (0, 0, 4, 4))]])


def test_pack_roundtrip():
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        t = (torch.randn(3, 5) * 1000).to(dt)
        assert torch.equal(unpack_tensor(pack_tensor(t)), t)


def test_layout_errors_name_the_parameter():
    with pytest.raises(LayoutError, match="x.qkv_proj.weight"):
        linear_pieces(
            "qkv",
            "x.qkv_proj.weight",
            (100, 8),
            logical_names=["q", "k", "v"],
            num_heads=2,
            num_kv_heads=1,
            total_num_heads=2,
            total_num_kv_heads=1,
            head_size=16,
        )
    with pytest.raises(LayoutError, match="gate_up"):
        linear_pieces("merged", "gate_up", (10, 8), logical_names=["g", "u"], output_sizes=[4, 4])
    with pytest.raises(LayoutError, match="emb"):
        vocab_pieces("emb", (64, 8), org_vocab_start=0, org_vocab_end=11, org_vocab_size=11, num_added=3)
    with pytest.raises(LayoutError, match="weird"):
        linear_pieces("weird", "weird", (4, 4))


def test_piece_is_a_view_not_a_copy():
    t = torch.zeros(6, 4)
    (v,) = piece_views(t, [Piece("w", 2, 4, Block(0, 0, 2, 4))])
    assert v.tensor.data_ptr() == t[2].data_ptr()
