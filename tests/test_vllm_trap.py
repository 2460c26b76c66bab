"""The vLLM-CPU prepack trap is real without espert's patch (run in a fresh process, ~15 s).

A plain ``LLM`` (no espert worker extension) prepacks the Linear weights at load:
``qkv_proj.weight`` becomes empty, and editing ``lm_head.weight`` in place does not change the
logprobs.  With espert's extension the layers stay prepacked, keep their plain weight, and repack
after every edit (espert/vllm/patches/cpu_prepack.py; tests/test_vllm_engine.py shows every edit reaching the
packed kernels).  If this test fails because the logprobs *do* change, vLLM stopped prepacking and
the repack hook may be unnecessary.
"""

import textwrap

import pytest

pytest.importorskip("vllm")

from fixtures.engine_script import run_engine_script  # noqa: E402

SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    from espert.tiny import build_tiny_model
    build_tiny_model(sys.argv[1], seed=0)
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=64, seed=0,
              enable_prefix_caching=False)
    sp = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True)
    def lps():
        o = llm.generate([{"prompt_token_ids": [1, 4, 5, 6, 10]}], sp, use_tqdm=False)[0].outputs[0]
        return [{k: v.logprob for k, v in s.items()} for s in o.logprobs]
    def probe(w):
        m = w.model_runner.model
        return tuple(m.model.layers[0].self_attn.qkv_proj.weight.shape)
    def edit(w):
        with torch.no_grad():
            w.model_runner.model.lm_head.weight.add_(1.0)
    before = lps()
    shape = llm.collective_rpc(probe)[0]
    llm.collective_rpc(edit)
    print("RESULT" + json.dumps({"qkv_shape": shape, "unchanged": lps() == before}))
""")


@pytest.mark.extended  # ESPERT_SLOW=1 (a canary for vLLM upgrades, ~3 min under load): by default
# tests/test_vllm_engine.py checks that every edit reaches the packed kernels with espert's patch
def test_without_patch_edits_are_silently_ignored(tmp_path):
    res = run_engine_script(SCRIPT, str(tmp_path / "tiny"), timeout=300)
    assert res["qkv_shape"] == [0], res  # prepacked: the Parameter is empty
    assert res["unchanged"], "editing lm_head.weight changed the logprobs: vLLM no longer prepacks it"
