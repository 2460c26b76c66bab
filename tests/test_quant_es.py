"""End to end: ES on a quantized tiny model (codes perturbed and updated in place) improves held-out
reward on the ``copy`` task, through the unchanged ES step and a TorchEvaluator whose center is the
quantized codes (``model_quant_center``)."""

import pytest

from espert.es import ESConfig, es_step, prompt_indices
from espert.evaluators.torch_model import TorchEvaluator, load_model
from espert.quant import model_quant_center, quantize_model
from espert.tasks.copy_task import make_copy_task
from espert.tiny import build_tiny_model


@pytest.mark.parametrize("fmt,noise", [("int8", "gaussian"), ("gptq", "gaussian"), ("int8", "rademacher")])
def test_es_on_a_quantized_tiny_model_improves_heldout_copy(fmt, noise, tmp_path):
    build_tiny_model(str(tmp_path / "tiny"), seed=0)
    model, tok = load_model(str(tmp_path / "tiny"))
    quantize_model(model, fmt, group_size=32, exclude=())  # every Linear, lm_head included
    train, test = make_copy_task(split="train"), make_copy_task(n=64, split="test")
    cfg = ESConfig(
        population=8, sigma=0.05, alpha=0.05, prompts_per_iteration=16, iterations=30, max_new_tokens=7, eval_size=64
    )
    center = model_quant_center(model, noise=noise)
    ev = TorchEvaluator(model, tok, train.score, max_new_tokens=7, batch_size=64, center=center)

    def heldout():
        r = ev.evaluate_center(test.prompts, test.answers)
        return sum(r) / len(r)

    before = heldout()
    codes0 = [c.clone() for c in ev.center.codes]
    for t in range(1, cfg.iterations + 1):
        idx = prompt_indices(cfg, t, len(train))
        es_step(ev, cfg, t, [train.prompts[i] for i in idx], [train.answers[i] for i in idx])
    after = heldout()
    assert any(not (c == c0).all() for c, c0 in zip(ev.center.codes, codes0))  # codes moved
    for v, c in zip(ev.center.views, ev.center.codes):  # live weights are the exact center
        assert (v.qw.qweight == c).all()
    print(f"\nheld-out {before:.3f} -> {after:.3f}")
    assert after > before + 0.04, (before, after)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "gptq", "awq"])
def test_the_export_layout_is_the_export_states_without_dequantizing(fmt, tmp_path):
    """A run checks that its export can be written before its first iteration; a quantized center says the
    layout of its float export without dequantizing the model (a transient float32 copy of every weight)."""
    build_tiny_model(str(tmp_path))
    model, _ = load_model(str(tmp_path))
    center = model_quant_center(quantize_model(model, fmt, group_size=32))
    assert center.export_layout() == {n: (tuple(t.shape), t.dtype) for n, t in center.export_state().items()}
