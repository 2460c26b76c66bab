"""Batched low-rank members (``vllm_members: batched``): a lowrank:r population as vLLM LoRA adapters.

- every LoRA slice (q, k, v of ``qkv_proj``; gate, up of ``gate_up_proj``; o_proj, down_proj) adds the
  in-place perturbation of its logical piece, to float32 rounding (``es_lora_error``), at TP=1 and TP=2;
- members generated together in one multi-LoRA ``generate`` score what the same members score
  perturbed in place, one at a time (the measured agreement is printed);
- the moved tensors are the ones LoRA carries, the same on the vLLM and the torch side (replay), and
  a batched run replays bit-identically on the CPU; norms and embeddings stay at the base;
- the mode is fixed for the life of a run: resuming with the other one is refused in one line.
"""

import os
import sys

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

from espert.config import ESConfig  # noqa: E402
from espert.tasks import load_task  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

MEMBERS = [(s, g) for s in (11, 12, 13, 2**63 + 5) for g in (1, -1)]
NOISE = "lowrank:4"


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """A random 2-layer Qwen2 (q/k/v biases, untied lm_head) with a BPE tokenizer."""
    from tiny_model import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("qwen2") / "model"), seed=3, arch="qwen2")


def _batched(model, score, **kw):
    from espert.vllm import VLLMEvaluator

    kw.setdefault("llm_kwargs", {})
    kw["llm_kwargs"] = {"max_model_len": 64, "multiprocess": False, **kw["llm_kwargs"]}
    return VLLMEvaluator(model, score, noise=NOISE, members="batched", max_loras=4, max_new_tokens=6, **kw)


@pytest.fixture(scope="module")
def ev(tiny_dir):
    e = _batched(tiny_dir, load_task("copy", "train", n=16).score)
    yield e
    e.close()


def test_every_lora_slice_adds_the_inplace_noise_of_its_piece(ev):
    errors = ev.rpc("es_lora_error", 2**63 + 5, -1, 0.05)[0]
    moved = ev.info[0]["params"]
    assert sorted(errors) == sorted(moved)
    kinds = {n.split(".")[-2] for n in moved}
    assert kinds == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    worst = max(errors.values())
    assert worst < 1e-6, errors  # float32 rounding of the factors (measured ~1e-7), never O(1)


def test_batched_members_score_what_inplace_members_score(ev, capsys):
    task = load_task("copy", "train", n=16)
    prompts, answers = task.prompts[:8], task.answers[:8]
    batched = ev.evaluate(MEMBERS, 0.3, prompts, answers)
    ev.members = "serial"  # the same engine and center, members perturbed in place one at a time
    try:
        serial = ev.evaluate(MEMBERS, 0.3, prompts, answers)
    finally:
        ev.members = "batched"
    assert len(set(serial)) > 2  # the members really differ
    same = sum(a == b for a, b in zip(batched, serial))
    with capsys.disabled():
        print(f"\n[lora] batched vs in-place rewards: {same}/{len(MEMBERS)} members equal; {batched} vs {serial}")
    assert max(abs(a - b) for a, b in zip(batched, serial)) <= 0.1
    assert same >= len(MEMBERS) - 1
    # the center is untouched by batched evaluation: center generation is the base's
    assert ev.live_state().keys() == ev.center_state().keys()
    for k, v in ev.live_state().items():
        assert torch.equal(v, ev.center_state()[k]), k


def test_chunks_larger_populations_over_the_slots(ev):
    task = load_task("copy", "train", n=16)
    many = [(s, g) for s in range(100, 105) for g in (1, -1)]  # 10 members, 4 slots: 3 calls
    out = ev.evaluate(many, 0.3, task.prompts[:4], task.answers[:4])
    assert len(out) == 10
    assert ev.evaluate(many[6:], 0.3, task.prompts[:4], task.answers[:4]) == out[6:]  # slots reused, no stale adapter


def test_moved_tensors_are_what_lora_carries_on_both_sides(qwen_dir):
    from espert.evaluators import load_model
    from espert.params import lora_carried, torch_param_views

    ev = _batched(qwen_dir, load_task("copy", "train", n=4).score)
    try:
        moved, unmoved = set(ev.info[0]["params"]), set(ev.unmoved)
        errors = ev.rpc("es_lora_error", 7, 1, 0.02)[0]
    finally:
        ev.close()
    model, _ = load_model(qwen_dir)
    torch_side = {v.name for v in lora_carried(model, torch_param_views(model))}
    assert moved == torch_side
    assert {"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"} <= unmoved
    assert any(n.endswith("q_proj.bias") for n in unmoved)  # 1-D biases: no rank-r adapter carries them
    assert max(errors.values()) < 1e-6


def test_batched_needs_lowrank_noise_and_vllm():
    with pytest.raises(ValueError, match="lowrank"):
        ESConfig(evaluator="vllm", vllm_members="batched", noise="gaussian")
    with pytest.raises(ValueError, match="evaluator: vllm"):
        ESConfig(evaluator="torch", vllm_members="batched", noise=NOISE)
    from espert.vllm.wire import batched_rank, lora_rank_for

    with pytest.raises(ValueError, match="lowrank"):
        batched_rank("rademacher")
    assert [lora_rank_for(r) for r in (1, 2, 4, 8, 9)] == [1, 8, 8, 8, 16]


def _cfg(tiny_dir, **kw):
    base = dict(
        model=tiny_dir,
        evaluator="vllm",
        vllm_members="batched",
        vllm_max_loras=4,
        vllm_max_model_len=64,
        noise=NOISE,
        task="copy",
        iterations=2,
        population=8,
        prompts_per_iteration=4,
        train_size=16,
        eval_size=4,
        max_new_tokens=4,
        checkpoint_every=1,
        sigma=0.2,
        alpha=0.05,
    )
    return ESConfig(**{**base, **kw})


def test_batched_run_replays_bit_identically_and_keeps_the_rest_at_the_base(tiny_dir, tmp_path):
    from safetensors.torch import load_file

    from espert import runs, train
    from espert.runs import replay

    run_dir = str(tmp_path / "run")
    train(_cfg(tiny_dir), run_dir, progress=False, echo=None)
    out = replay(run_dir, echo=None)
    assert out["matches_checkpoint"] is True
    center = load_file(os.path.join(run_dir, runs.CENTER))
    assert "model.norm.weight" not in center and "model.embed_tokens.weight" not in center
    assert "model.layers.0.self_attn.q_proj.weight" in center
    base = load_file(os.path.join(tiny_dir, "model.safetensors"))
    exported = load_file(os.path.join(run_dir, "export", "model.safetensors"))
    assert torch.equal(exported["model.norm.weight"], base["model.norm.weight"])
    assert not torch.equal(exported["model.layers.0.mlp.down_proj.weight"], base["model.layers.0.mlp.down_proj.weight"])

    # the mode is part of the run: resuming with in-place members is refused before anything runs
    with pytest.raises(ValueError, match="vllm_members"):
        train(_cfg(tiny_dir, vllm_members="serial", iterations=3), run_dir, resume=True, progress=False, echo=None)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="vLLM-CPU TP=2 needs one core per rank")
def test_tp2_slices_hold_each_ranks_piece(tiny_dir, monkeypatch):
    """Column-parallel slices hold a rank's rows of A', row-parallel ones its columns of Bᵀ.  (Its own engine
    only: an in-process engine of this module may be unusable once another in-process engine has shut down.)"""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    task = load_task("copy", "train", n=16)
    prompts, answers = task.prompts[:8], task.answers[:8]
    tp = _batched(
        tiny_dir,
        task.score,
        llm_kwargs=dict(multiprocess=True, tensor_parallel_size=2, distributed_executor_backend="mp"),
    )
    try:
        assert [r["tp_size"] for r in tp.info] == [2, 2]
        errors = tp.rpc("es_lora_error", 2**63 + 5, -1, 0.05)
        layout = tp.rpc("es_layout")
        batched = tp.evaluate(MEMBERS, 0.3, prompts, answers)
        tp.members = "serial"
        serial = tp.evaluate(MEMBERS, 0.3, prompts, answers)
    finally:
        tp.close()
    for rank, info in zip(errors, tp.info):
        assert sorted(rank) == sorted(info["params"]) and max(rank.values()) < 1e-6, rank
    kinds = {n.split(".")[-2] for n in tp.info[0]["params"]}
    assert kinds == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    q, o = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    assert [next(b for n, _, b, _ in r if n == q)[0] for r in layout] == [0, 32]  # q: row shards
    assert [next(b for n, _, b, _ in r if n == o)[1] for r in layout] == [0, 32]  # o_proj: column shards
    assert len(set(serial)) > 2
    assert sum(a == b for a, b in zip(batched, serial)) >= len(MEMBERS) - 1, (batched, serial)


@pytest.mark.parametrize("order", ["slots in order", "runs", "uneven runs", "scattered"])
def test_cpu_lora_ops_equal_vllms_own(order):
    """espert's CPU LoRA ops against vLLM's gather-per-token CPU ops, on random slots."""
    import espert.vllm.engine.worker  # noqa: F401  (installs espert's ops, keeping vLLM's in VLLM_OPS)
    from espert.vllm.patches import lora_cpu as lora

    g = torch.Generator().manual_seed(0)
    k, r, d_in, d_out = 5, 8, 48, 40
    if order == "slots in order":  # espert's fill order: the slots' weights are a slice
        idx = torch.tensor([1, 2, 3]).repeat_interleave(torch.tensor([9, 9, 2]))
    elif order == "runs":  # how members arrive: each slot's requests in a row, equal counts, a subset of slots
        idx = torch.tensor([3, 1, 4, 0]).repeat_interleave(9)
    elif order == "uneven runs":  # a prefill chunk that cuts the last member's prompts
        idx = torch.tensor([3, 1, 4, 0]).repeat_interleave(torch.tensor([9, 9, 9, 4]))
    else:
        idx = torch.randint(0, k, (37,), generator=g)
    t = idx.numel()
    assert (lora._runs(idx, k) is None) == (order == "scattered")
    x = torch.randn(t, d_in, generator=g)
    a = torch.randn(k, 1, r, d_in, generator=g)
    b = torch.randn(k, 1, d_out, r, generator=g)
    h_ours, h_vllm = torch.zeros(t, r), torch.zeros(t, r)
    lora.cpu_shrink(x, a, h_ours, idx, 0.5)
    lora.VLLM_OPS["bgmv_shrink"](x, a, h_vllm, idx, 0.5)
    torch.testing.assert_close(h_ours, h_vllm, rtol=1e-5, atol=1e-5)
    base = torch.randn(t, d_out + 8, generator=g)
    y_ours, y_vllm = base.clone(), base.clone()
    lora.cpu_expand(h_vllm, b, y_ours, idx, True)
    lora.VLLM_OPS["bgmv_expand"](h_vllm, b, y_vllm, idx, True)
    torch.testing.assert_close(y_ours, y_vllm, rtol=1e-5, atol=1e-5)
    y_ours, y_vllm = base.clone(), base.clone()
    lora.cpu_expand_slice(h_vllm, b, y_ours, idx, 4, d_out, True)
    lora.VLLM_OPS["bgmv_expand_slice"](h_vllm, b, y_vllm, idx, 4, d_out, True)
    torch.testing.assert_close(y_ours, y_vllm, rtol=1e-5, atol=1e-5)
    # a refill of the slots (in place, as LoraSlots.fill writes them) is seen by the next expand
    b[2].mul_(3.0)
    y_ours, y_vllm = base.clone(), base.clone()
    lora.cpu_expand(h_vllm, b, y_ours, idx, False)
    lora.VLLM_OPS["bgmv_expand"](h_vllm, b, y_vllm, idx, False)
    torch.testing.assert_close(y_ours, y_vllm, rtol=1e-5, atol=1e-5)
    # tokens without an adapter (index -1) get no LoRA term
    idx[:5] = -1
    h = torch.full((t, r), 7.0)
    lora.cpu_shrink(x, a, h, idx)
    assert torch.all(h[:5] == 0)
    y = base.clone()
    lora.cpu_expand(torch.ones(t, r), b, y, idx, True)
    assert torch.equal(y[:5], base[:5])
