"""The vLLM evaluator through the ES loop: parity with the transformers evaluator, and training.

- greedy fp32 decoding: the vLLM and torch evaluators give identical completions and rewards for
  the same seeds on the same tiny model and prompts, and the same extracted answers per member;
- a few ES iterations through vLLM raise the reward of the center on the ``copy`` task, and the
  loop's answer diversity is logged from the members' extracted answers;
- the ``vllm`` evaluator is registered with the ES loop's evaluator registry.
"""

import os

import numpy as np
import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

from espert.tasks import load_task  # noqa: E402
from espert.update import Update  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
MEMBERS = [(s, g) for s in (101, 202, 303, 2**63 + 7) for g in (1, -1)]


@pytest.fixture(scope="module")
def ev(tiny_dir):
    from espert.vllm import VLLMEvaluator, make_llm
    from espert.vllm.driver.evaluator import shutdown_llm

    task = load_task("copy", "train", n=64)
    e = VLLMEvaluator(
        make_llm(tiny_dir, max_model_len=64, multiprocess=False), task.score, max_new_tokens=6, extract=task.extract
    )
    yield e
    shutdown_llm(e.llm)


def test_parity_with_transformers_evaluator(ev, tiny_dir):
    from espert.evaluators import TorchEvaluator, load_model

    task = load_task("copy", "train", n=24)
    model, tok = load_model(tiny_dir)
    tev = TorchEvaluator(model, tok, task.score, max_new_tokens=6, batch_size=64, extract=task.extract)
    assert ev.generate(task.prompts) == tev.generate(task.prompts)
    rv = ev.evaluate(MEMBERS, 0.05, task.prompts, task.answers)
    rt = tev.evaluate(MEMBERS, 0.05, task.prompts, task.answers)
    assert rv == rt
    assert ev.member_answers == tev.member_answers and len(ev.member_answers) == len(MEMBERS)
    assert len(set(rv)) > 2  # the members really differ
    # after an update, still identical (same fp32 master arithmetic on both sides)
    start = ev.center_state()
    ev.update(Update([101, 202], [0.02, -0.01], 0.99))
    tev.update(Update([101, 202], [0.02, -0.01], 0.99))
    assert ev.evaluate(MEMBERS[:4], 0.05, task.prompts, task.answers) == tev.evaluate(
        MEMBERS[:4], 0.05, task.prompts, task.answers
    )
    got = ev.center_state()
    for k, v in tev.center_state().items():
        assert torch.equal(got[k], v), k
    ev.load_center(start)


def test_es_training_through_vllm_raises_reward(ev):
    from espert.diagnostics import IterationMeter
    from espert.es import ESConfig, es_step, prompt_indices

    task = load_task("copy", "train", n=64)
    start = ev.center_state()
    probe_p, probe_a = task.prompts[:16], task.answers[:16]
    cfg = ESConfig(population=8, sigma=0.05, alpha=0.025, prompts_per_iteration=16, iterations=4, max_new_tokens=6)
    r0 = float(np.mean(ev.evaluate_center(probe_p, probe_a)))
    after, js = [], []
    meter = IterationMeter(ev)  # the loop's diagnostics, as espert.train logs them
    try:
        for t in range(1, 5):
            idx = prompt_indices(cfg, t, len(task))
            rec = es_step(ev, cfg, t, [task.prompts[i] for i in idx], [task.answers[i] for i in idx])
            js.append(meter(rec)["answers"]["js"])
            after.append(float(np.mean(ev.evaluate_center(probe_p, probe_a))))
        assert all(0.0 <= j <= 3.0 for j in js) and max(js) > 0  # 8 members: at most log2(8) bits
        assert np.mean(after[2:]) > r0 + 0.05, (r0, after)  # iterations 3-4 (the loop's defaults move slowly at first)
    finally:
        ev.load_center(start)
    print(f"copy reward of the center: {r0:.3f} -> {after}; answer JS {js} bits; timings {ev.timings}")


def test_edits_at_another_thread_count_repack_correctly(ev, set_torch_threads):
    """An edit repacks vLLM-CPU's oneDNN weights; packing at another thread count than the load's gave
    wrong products (the restored center decoded "bababa"), so espert packs at the load's count."""
    task = load_task("copy", "train", n=12)
    threads = torch.get_num_threads()
    want = ev.generate(task.prompts)
    ev.perturb(5, 0.05)
    perturbed = ev.generate(task.prompts)
    ev.restore()
    set_torch_threads(1 if threads > 1 else 2)
    ev.perturb(5, 0.05)
    assert ev.generate(task.prompts) == perturbed
    ev.restore()
    assert ev.generate(task.prompts) == want


def test_backend_registered():
    from espert.evaluators import get_builder
    from espert.vllm.driver.build import build_from_config

    assert get_builder("vllm") is build_from_config


def test_loop_fields_give_the_torch_evaluators_centers(ev, tiny_dir, tmp_path):
    """noise lowrank:2, adam, sigma_mode rms and weight decay with exclusions through vLLM: a few ES
    iterations give the torch evaluator's rewards, centers and optimizer state bit for bit, and the
    streamed checkpoint is the torch center's file byte for byte.  (The module's engine is set up again
    with the loop fields, then given back its default center.)"""
    from espert.es import ESConfig, apply_record, es_step, prompt_indices
    from espert.evaluators import TorchEvaluator, config_center, load_model
    from espert.runs import write_safetensors
    from espert.tensorfile import write_chunks
    from espert.vllm import VLLMEvaluator
    from espert.vllm.driver.build import center_kwargs, checkpoint_rms_scales

    cfg = ESConfig(
        population=4,
        sigma=0.05,
        alpha=0.02,
        prompts_per_iteration=8,
        iterations=3,
        max_new_tokens=6,
        noise="lowrank:2",
        optimizer="adam",
        sigma_mode="rms",
        weight_decay=0.5,
        weight_decay_exclude=["norm", "*embed_tokens*"],
    )
    task = load_task("copy", "train", n=64)
    model, tok = load_model(tiny_dir)
    tev = TorchEvaluator(model, tok, task.score, max_new_tokens=6, center=config_center(model, cfg))
    scales = checkpoint_rms_scales(tiny_dir, cfg.dtype)
    assert len(set(scales.values())) > 3  # real per-tensor scales
    vev = VLLMEvaluator(ev.llm, task.score, max_new_tokens=6, **center_kwargs(cfg, tiny_dir))  # as the CLI builds it
    start = vev.center_state()
    try:
        assert start["optim.step"].tolist() == [0] and "optim.v/model.layers.0.self_attn.k_proj.weight" in start
        for t in range(1, 4):
            idx = prompt_indices(cfg, t, len(task))
            p, a = [task.prompts[i] for i in idx], [task.answers[i] for i in idx]
            rec = es_step(vev, cfg, t, p, a)
            assert tev.evaluate([tuple(m) for m in rec["members"]], rec["sigma"], p, a) == rec["rewards"]
            apply_record(tev, rec)
        got, want = vev.center_state(), tev.center_state()
        assert sorted(got) == sorted(want) and want["optim.step"].tolist() == [3]
        for k, v in want.items():
            assert torch.equal(got[k], v), k
        assert not torch.equal(got["model.norm.weight"], start["model.norm.weight"])  # moved, not decayed
        assert sorted(vev.export_state()) == sorted(tev.export_state())
        a, b = str(tmp_path / "vllm.safetensors"), str(tmp_path / "torch.safetensors")
        assert write_chunks(a, vev.center_stream()) == write_safetensors(b, want)
        # load_center takes the optimizer state back: the next update continues exactly
        vev.load_center(start)
        vev.load_center(got)
        rec = {"seeds": [7, 8], "coeffs": [0.01, -0.02], "decay": 0.99, "alpha": 0.02}
        apply_record(vev, rec)
        apply_record(tev, rec)
        got, want = vev.center_state(), tev.center_state()
        for k, v in want.items():
            assert torch.equal(got[k], v), k
    finally:
        vev.load_center(start)  # the base weights, then the module's default center again
        ev.rpc("es_setup")
