"""bf16 live weights inside vLLM: the same bits as transformers bf16, and exact restores (~10 s).

Restoring by subtracting noise is wrong for a few percent of bf16 elements; espert restores from
the float32 host center, so the live bf16 weights return to the same bits after any number of cycles.
"""

import os

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

from espert.center import CenterStore  # noqa: E402
from espert.params import torch_param_views  # noqa: E402
from espert.tasks import load_task  # noqa: E402
from espert.tiny import build_tiny_model  # noqa: E402
from espert.update import Update  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from espert.vllm import VLLMEvaluator, make_llm
    from espert.vllm.driver.evaluator import shutdown_llm

    d = str(tmp_path_factory.mktemp("vllm_tiny_bf16"))
    build_tiny_model(d, seed=0)
    ev = VLLMEvaluator(
        make_llm(d, dtype="bfloat16", max_model_len=64, multiprocess=False),
        load_task("copy", "train", n=8).score,
        max_new_tokens=4,
    )
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    yield ev, hf
    shutdown_llm(ev.llm)


def same(ev, hf):
    live = ev.live_state()
    return all(torch.equal(live[k].view(torch.int16), p.data.view(torch.int16)) for k, p in hf.named_parameters())


def test_bf16_bitwise_and_exact_restore(setup):
    ev, hf = setup
    assert same(ev, hf)
    start = {k: v.clone() for k, v in ev.live_state().items()}
    hc = CenterStore(torch_param_views(hf))
    for seed in range(20):
        hc.perturb(seed, 0.01, 1 - 2 * (seed % 2))
        ev.perturb(seed, 0.01, 1 - 2 * (seed % 2))
        assert same(ev, hf)
        hc.restore()
        ev.restore()
    live = ev.live_state()
    assert all(torch.equal(live[k].view(torch.int16), start[k].view(torch.int16)) for k in start)
    hc.update(Update([1, 2], [1e-4, -2e-4], 1.0))
    ev.update(Update([1, 2], [1e-4, -2e-4]))
    assert same(ev, hf)
    assert all(v.dtype == torch.float32 for v in ev.center_state().values())  # the master stays float32
