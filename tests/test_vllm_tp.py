"""vLLM with the V1 engine core in its own process and tensor_parallel_size=2 (two CPU workers).

Each rank perturbs its own q/k/v and gate/up shards, o_proj/down_proj column shards and vocab
rows; the reassembled live weights equal the transformers weights after the same perturbation
(bitwise), the rewards equal the transformers evaluator's, and center_state reassembles the
logical tensors from both ranks.  vLLM-CPU needs one core per rank (``VLLM_CPU_OMP_THREADS_BIND``);
the test is skipped on a machine with fewer than 2 cores.  Runtime: ~1 min (process spawns).
"""

import os

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

from espert.tasks import load_task  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="vLLM-CPU TP=2 needs one core per rank")


@pytest.fixture(scope="module")
def ev(tiny_dir):
    from espert.vllm import VLLMEvaluator, make_llm
    from espert.vllm.driver.evaluator import shutdown_llm

    old = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    try:
        llm = make_llm(
            tiny_dir, max_model_len=64, multiprocess=True, tensor_parallel_size=2, distributed_executor_backend="mp"
        )
    finally:
        if old is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = old
    e = VLLMEvaluator(llm, load_task("copy", "train", n=16).score, max_new_tokens=6)
    yield e
    shutdown_llm(llm)


def test_tp2_multiprocess_matches_transformers(ev, tiny_dir):
    from espert.center import CenterStore
    from espert.evaluators import TorchEvaluator, load_model
    from espert.params import torch_param_views

    assert [r["tp_size"] for r in ev.info] == [2, 2]
    layout = ev.rpc("es_layout")
    q = "model.layers.0.self_attn.q_proj.weight"
    blocks = [next(b for n, _, b, _ in rank if n == q) for rank in layout]
    assert [b[0] for b in blocks] == [0, 32]  # q rows split over the ranks
    o = "model.layers.0.self_attn.o_proj.weight"
    assert [next(b for n, _, b, _ in rank if n == o)[1] for rank in layout] == [0, 32]  # o_proj: column shards

    model, tok = load_model(tiny_dir)
    ref = dict(model.named_parameters())
    hc = CenterStore(torch_param_views(model))
    hc.perturb(31337, 0.05, -1)
    ev.perturb(31337, 0.05, -1)
    live = ev.live_state()
    assert sorted(live) == sorted(ref)
    for k, v in ref.items():
        assert torch.equal(live[k].view(torch.int32), v.data.view(torch.int32)), k
    hc.restore()
    ev.restore()
    center = ev.center_state()
    for k, v in ref.items():
        assert torch.equal(center[k], v.data), k

    task = load_task("copy", "train", n=16)
    tev = TorchEvaluator(model, tok, task.score, max_new_tokens=6)
    members = [(5, 1), (5, -1), (6, 1), (6, -1)]
    assert ev.evaluate(members, 0.05, task.prompts, task.answers) == tev.evaluate(
        members, 0.05, task.prompts, task.answers
    )
    sums = ev.checksum()
    assert [s["rank"] for s in sums] == [0, 1]


def test_tp2_loop_fields_give_the_torch_centers(ev, tiny_dir):
    """noise lowrank:3, adam, sigma_mode rms and decay exclusions at TP=2: each rank updates its shards of q/k/v,
    gate/up, o/down and the vocabulary with the scale of the whole logical tensor (computed once from the
    checkpoint), and the reassembled centers and optimizer slots equal the torch evaluator's bit for bit."""
    from espert.es import ESConfig, apply_record
    from espert.evaluators import config_center, load_model
    from espert.evaluators.torch_model import rms_scales
    from espert.params import torch_param_views
    from espert.vllm import VLLMEvaluator
    from espert.vllm.driver.build import center_kwargs, checkpoint_rms_scales

    cfg = ESConfig(
        noise="lowrank:3",
        optimizer="adam",
        sigma_mode="rms",
        weight_decay=0.5,
        alpha=0.02,
        weight_decay_exclude=["norm", "bias"],
    )
    model, _ = load_model(tiny_dir)
    scales = checkpoint_rms_scales(tiny_dir, cfg.dtype)
    views = torch_param_views(model)
    assert [scales[v.name] for v in views] == rms_scales(views)  # the torch evaluator's scales, exactly
    host = config_center(model, cfg)
    vev = VLLMEvaluator(ev.llm, ev.score, **center_kwargs(cfg, tiny_dir))  # as the CLI builds it
    start = vev.center_state()
    try:
        for t, seeds in enumerate(([11, 12, 13], [14, 15], [16]), 1):
            rec = {"seeds": seeds, "coeffs": [0.03 / t] * len(seeds), "decay": 0.99, "alpha": 0.02}
            apply_record(vev, rec)
            apply_record(host, rec)
        got, want = vev.center_state(), host.state_dict()
        assert sorted(got) == sorted(want) and got["optim.step"].tolist() == [3]
        for k, v in want.items():
            assert torch.equal(got[k], v), k
        vev.perturb(99, 0.05, 1)
        host.perturb(99, 0.05, 1)
        live = vev.live_state()
        for v in host.views:
            assert torch.equal(live[v.name], v.tensor), v.name
    finally:
        vev.load_center(start)
        ev.rpc("es_setup")
