"""Prefix-cached KV is stale after a weight change; espert prevents it.

The engine here is created with prefix caching ON (the trap).  We show that (1) without a reset,
a prompt whose prefix was cached under the old weights is scored with stale KV after a
perturbation (its logprobs differ from a fresh computation under the new weights), and (2) the
evaluator's path (``reset_prefix_cache()`` after every weight change) gives the fresh result.
espert's own engines (``make_llm``) also turn prefix caching off.
"""

import os

import pytest

vllm = pytest.importorskip("vllm")

from espert.tasks import load_task  # noqa: E402
from espert.tiny import build_tiny_model  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# 33 characters -> 34 tokens with <s>: one full 32-token block (CPU attention needs multiples of 32) gets cached
LONG = "abcdefabcdefabcdefabcdefabcdefab>"


@pytest.fixture(scope="module")
def ev(tmp_path_factory):
    from espert.vllm import VLLMEvaluator, make_llm
    from espert.vllm.driver.evaluator import shutdown_llm

    d = str(tmp_path_factory.mktemp("vllm_tiny_pc"))
    build_tiny_model(d, seed=0)
    llm = make_llm(d, max_model_len=64, multiprocess=False, enable_prefix_caching=True, block_size=32)
    e = VLLMEvaluator(llm, load_task("copy", "train", n=4).score, max_new_tokens=4)
    yield e
    shutdown_llm(llm)


def logprobs(ev):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True)
    out = ev.llm.generate(ev._token_prompts([LONG]), sp, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), [{k: v.logprob for k, v in s.items()} for s in out.logprobs]


def test_make_llm_disables_prefix_caching_by_default():
    import inspect

    from espert.vllm import make_llm

    assert inspect.signature(make_llm).parameters["enable_prefix_caching"].default is False


def test_stale_prefix_cache_is_prevented(ev):
    # fresh result under the perturbed weights: cache emptied after the change
    ev.perturb(42, 0.2, 1)  # (evaluator resets the cache)
    fresh = logprobs(ev)
    ev.restore()
    center = logprobs(ev)  # fills the prefix cache with KV computed under the center
    assert fresh != center

    # the trap: change weights without resetting -> the cached prefix KV is stale
    ev.reset_cache = False
    try:
        ev.rpc("es_perturb", 42, 0.2, 1)
        stale = logprobs(ev)
        assert stale != fresh, "expected stale KV from the prefix cache (the trap did not reproduce)"
        ev.rpc("es_restore")
        logprobs(ev)  # cache holds center KV again
    finally:
        ev.reset_cache = True

    # espert's path: every weight change resets the prefix cache -> fresh results
    ev.perturb(42, 0.2, 1)
    assert logprobs(ev) == fresh
    ev.restore()
    assert logprobs(ev) == center
