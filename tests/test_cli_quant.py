"""espert train --quant: ES on a locally quantized model from the CLI, with exact resume/replay and a
float export that holds the dequantized center codes."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

ARGS = [
    "--iterations",
    "4",
    "--pretrain-steps",  # random-init tiny base (pretraining costs ~30 s and is not what these tests check)
    "0",
    "--population",
    "4",
    "--prompts-per-iteration",
    "4",
    "--eval-size",
    "8",
    "--eval-every",
    "2",
    "--checkpoint-every",
    "2",
    "--sigma",
    "0.05",
    "--alpha",
    "0.05",
    "--no-progress",
]


def _espert(*args):
    """The CLI in this process (``python -m espert`` is exercised by test_chaos and test_runs)."""
    from espert.cli import main

    assert main(list(args)) == 0, args


@pytest.mark.parametrize(
    "fmt,noise",
    [
        ("int8", "gaussian"),
        ("awq", "gaussian"),
        # ESPERT_SLOW=1 (about a minute each): by default the quantized center under these families is checked
        # by tests/test_quant.py (perturb, restore, update bits for every family) and test_quant_es.py (ES
        # iterations, int8 rademacher); the CLI's train/resume/replay path is the same for every family
        pytest.param("int8", "rademacher", marks=pytest.mark.extended),
        pytest.param("int8", "lowrank:2", marks=pytest.mark.extended),
    ],
)
def test_train_quantized_then_replay_bit_identical(tmp_path, capsys, fmt, noise):
    run = str(tmp_path / "run")
    quant = ["--quant", fmt, "--quant-group-size", "32", "--noise", noise]
    _espert("train", "--run-dir", run, *quant, *ARGS)
    capsys.readouterr()
    _espert("replay", run, "--out", str(tmp_path / "replay"))
    out = "".join(capsys.readouterr())
    assert "bit-identical" in out and ": yes" in out, out
    # the export is a float checkpoint whose quantized Linear weights are exactly the dequantized codes
    from espert.evaluators.torch_model import load_model
    from espert.quant import model_quant_center, quantize_model

    model, _ = load_model(os.path.join(run, "base_model"))
    center = model_quant_center(quantize_model(model, fmt, group_size=32), noise=noise)
    center.load_state_dict(load_file(os.path.join(run, "center.safetensors")))
    exported = load_file(os.path.join(run, "export", "model.safetensors"))
    for name, value in center.export_state().items():
        assert torch.equal(exported[name], value.to(exported[name].dtype)), name
    base = load_file(os.path.join(run, "base_model", "model.safetensors"))
    assert any(not torch.equal(exported[n], base[n]) for n in center.export_state())  # ES moved something
    assert json.load(open(os.path.join(run, "export", "espert_export.json")))["iteration"] == 4
    # stop after 2 iterations, resume to 4: the same center, bit for bit
    part = str(tmp_path / "part")
    _espert("train", "--run-dir", part, *quant, *ARGS[:1], "2", *ARGS[2:])
    _espert("train", "--run-dir", part, "--resume", "--iterations", "4", "--no-progress")
    a, b = load_file(os.path.join(run, "center.safetensors")), load_file(os.path.join(part, "center.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_quant_config_errors():
    from espert.es import ESConfig

    with pytest.raises(ValueError, match="quant must be"):
        ESConfig(quant="int3")
    with pytest.raises(ValueError, match="vLLM loads quantized"):
        ESConfig(quant="int8", evaluator="vllm")
    with pytest.raises(ValueError, match="include/exclude"):
        ESConfig(quant="int8", exclude=["norm"])
