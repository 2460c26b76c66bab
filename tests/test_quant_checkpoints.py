"""Quantized checkpoints as users have them (issue 49): made at test time by llm-compressor, GPTQModel and AutoAWQ,
trained in place through both evaluators, exported in their own format.

The float base is a tiny Llama from transformers (tests/fixtures/tiny_model.py); the quantizers
(tests/fixtures/quantizers.py) make of it: llm-compressor 0.14, compressed-tensors checkpoints W8A8 int8
(``int-quantized``) and W4A16 int4 (``pack-quantized``: symmetric by group, asymmetric by group, symmetric by
channel); GPTQModel 7.6, a GPTQ checkpoint (with and without act-order) and an AWQ one (``gemm``); AutoAWQ 0.2.9,
its own AWQ ``gemm``.  Before this, on main b6865f0:

- ``espert train --evaluator vllm`` refused every W4A16 checkpoint: ``LayoutError: ...qkv_proj.weight_packed: dtype
  torch.int32 (quantized or packed storage) cannot be perturbed through vLLM by espert``;
- ``espert train`` (torch) refused both: ``parameter ...q_proj.weight has dtype torch.int8`` (W8A8),
  ``...q_proj.weight_packed has dtype torch.int32`` (W4A16).

- both evaluators refused GPTQ and AWQ checkpoints: ``quantization method 'gptq': espert reads compressed-tensors
  checkpoints`` (and transformers alone cannot load them without optimum and GPTQModel);
- on 002bafb, both refused GPTQ with act-order and groups: ``GPTQ gptq int4 group 32 sym, act-order on every
  Linear: espert edits GPTQ (format gptq, symmetric, act-order only without groups, ...)``.

The W4A16 group-symmetric, GPTQ, act-order GPTQ, GPTQModel's AWQ (codes in vLLM) and AutoAWQ's AWQ (training) cases
run in CI; the other schemes with ``ESPERT_SLOW=1``.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from fixtures import quantizers as compressed
from fixtures.tiny_model import build_tiny_model
from safetensors import safe_open

from espert import runs
from espert.cli import main
from espert.quant.center import master_codes
from espert.quant.checkpoint import (
    act_orders,
    int4_codes,
    load_packed_model,
    packed_weight,
    quantization_config,
    weight_scheme,
)

pytestmark = pytest.mark.skipif(not compressed.available(), reason="llm-compressor is not in .venv/quantizers")
gptqmodel = pytest.mark.skipif(not compressed.has_gptqmodel(), reason="GPTQModel is not in .venv/quantizers")
autoawq = pytest.mark.skipif(not compressed.has_autoawq(), reason="AutoAWQ is not in .venv/quantizers")

SLOW = os.environ.get("ESPERT_SLOW") == "1"
W4 = ["W4A16"] + (["W4A16-asym", "W4A16-channel"] if SLOW else [])
TRAIN = [
    "--iterations", "2", "--population", "2", "--prompts-per-iteration", "2", "--max-new-tokens", "3",
    "--eval-size", "2", "--train-size", "8", "--no-progress", "--sigma", "0.5", "--alpha", "2.0",
    "--task", "custom_rewards:VARIED_TASK",
]  # fmt: skip


@pytest.fixture(autouse=True)
def fixtures_on_path(monkeypatch):
    """custom_rewards (its VARIED_TASK steps every iteration of an untrained model) importable, as a user's is."""
    here = os.path.join(os.path.dirname(__file__), "fixtures")
    monkeypatch.syspath_prepend(here)
    monkeypatch.setenv("PYTHONPATH", here + os.pathsep + os.environ.get("PYTHONPATH", ""))


_made: dict[tuple[str, str], str] = {}


@pytest.fixture
def checkpoint_of(tmp_path_factory):
    """(scheme, arch) -> a directory llm-compressor wrote from a tiny transformers model of ``arch`` (made once per
    module; Qwen2 has biases on q, k and v, as Qwen2.5 checkpoints do)."""

    def make(scheme: str, arch: str = "llama") -> str:
        if (arch, "float") not in _made:
            _made[arch, "float"] = build_tiny_model(str(tmp_path_factory.mktemp(arch) / "model"), arch=arch)
        if (arch, scheme) not in _made:
            out = str(tmp_path_factory.mktemp(f"{arch}-{scheme}") / "model")
            _made[arch, scheme] = compressed.quantize(_made[arch, "float"], out, scheme)
        return _made[arch, scheme]

    return make


def tensors(d: str) -> dict[str, torch.Tensor]:
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def checkpoint_codes(d: str) -> dict[str, torch.Tensor]:
    """Logical int codes [N, K] of every quantized weight, by the weight's float name: compressed-tensors' decoded
    with its own unpacker (int8 as stored; int4 as the stored nibble, the signed value + 8), GPTQ's and AWQ's
    ``qweight`` with espert's (vLLM decodes them on its own: the tests compare the two)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    fmt = weight_scheme(quantization_config(d))["format"]
    if fmt in ("gptq", "awq"):
        return {
            k.removesuffix(".qweight") + ".weight": int4_codes(fmt, t) for k, t in tensors(d).items() if "qweight" in k
        }
    out = {}
    for k, t in tensors(d).items():
        if k.endswith(".weight_packed"):
            name = k.removesuffix("_packed")
            shape = torch.Size(tensors(d)[name + "_shape"].tolist())
            out[name] = unpack_from_int32(t, 4, shape).to(torch.int32) + 8
        elif k.endswith(".weight") and t.dtype == torch.int8:
            out[k] = t.to(torch.int32)
    return out


def _outside(d: str, seed: int, sigma: float, sign: int) -> dict[str, torch.Tensor]:
    """The checkpoint's codes perturbed by espert's op outside any engine (int4 through the GPTQ layout)."""
    from espert import ops
    from espert.noise import param_key
    from espert.quant import QuantWeight, pack_codes_, unpack_codes

    st, out, scheme = tensors(d), {}, weight_scheme(quantization_config(d))
    for name, codes in checkpoint_codes(d).items():
        n, k = codes.shape
        if scheme["format"] in ("gptq", "awq"):  # the stored words, with the stored scales (float16 for GPTQ)
            qw, _ = packed_weight(scheme["format"], name.removesuffix(".weight"), st, n, k, scheme["group_size"])
            ops.perturb_(qw, seed, param_key(name), sigma, sign)
            out[name] = unpack_codes(qw)
            continue
        s = st[name + "_scale"].float()
        if codes.abs().max() > 15 or st[name].dtype == torch.int8 if name in st else False:
            qw = QuantWeight("int8", codes.to(torch.int8), s.reshape(-1), n, k)
        else:
            g = k // s.shape[1] if s.shape[1] > 1 else -1
            qw = QuantWeight("gptq", torch.zeros(k // 8, n, dtype=torch.int32), s.t().contiguous(), n, k, g)
            pack_codes_(qw, codes)
        ops.perturb_(qw, seed, param_key(name), sigma, sign)
        out[name] = unpack_codes(qw)
    return out


@pytest.mark.parametrize(
    "scheme",
    W4
    + [pytest.param(s, marks=gptqmodel) for s in ("GPTQ", "AWQ")]
    + ([pytest.param("AutoAWQ", marks=autoawq)] if SLOW else []),
)
def test_vllm_edits_the_w4a16_codes_where_vllm_cpu_reads_them(checkpoint_of, scheme):
    """Through vLLM-CPU's CPUWNA16 layout ([N/16, 2K], fused qkv and gate_up), into which vLLM repacks
    compressed-tensors, GPTQ and AWQ alike: the codes vLLM loaded are the checkpoint's; after a perturb they equal the
    checkpoint's codes perturbed outside (by float name, with the checkpoint's own scales: vLLM casts GPTQ's float16
    ones to bfloat16); the outputs move; restore is exact."""
    pytest.importorskip("vllm")
    from espert.quant import unpack_codes
    from espert.tasks import load_task
    from espert.vllm import VLLMEvaluator, make_llm
    from espert.vllm.driver.evaluator import shutdown_llm

    d = checkpoint_of(scheme)
    ev = VLLMEvaluator(make_llm(d, max_model_len=64, multiprocess=False), load_task("copy", "train", n=4).score)
    try:

        def live(worker):
            q = worker._es_center.inner.quant
            return {v.name: unpack_codes(v.qw) for v in q.views}, type(q.views[0].qw).__name__, q.views[0].qw.fmt

        def logprobs():
            from vllm import SamplingParams

            sp = SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, ignore_eos=True)
            out = ev.llm.generate([[1, 4, 5], [2, 3]], sp, use_tqdm=False)
            return [[{k: v.logprob for k, v in s.items()} for s in o.outputs[0].logprobs] for o in out]

        codes, _, fmt = ev.llm.collective_rpc(live)[0]
        assert fmt == "cpu_w4a16"
        base = checkpoint_codes(d)
        assert sorted(codes) == sorted(base) and len(codes) == 14  # q, k, v, o, gate, up, down x 2 layers
        assert all(torch.equal(codes[k], base[k]) for k in base)
        before = logprobs()
        ev.perturb(2**63 + 5, 0.7, -1)
        inside, outside = ev.llm.collective_rpc(live)[0][0], _outside(d, 2**63 + 5, 0.7, -1)
        moved = sum(int((outside[k] != base[k]).sum()) for k in base)
        assert moved > 1000 and all(torch.equal(inside[k], outside[k]) for k in base)
        assert logprobs() != before  # vLLM computes with the edited codes
        ev.restore()
        assert all(torch.equal(c, base[k]) for k, c in ev.llm.collective_rpc(live)[0][0].items())
        assert logprobs() == before
    finally:
        shutdown_llm(ev.llm)


def _train(model_dir: str, run: str, *evaluator: str) -> None:
    assert main(["train", "--run-dir", run, "--model", model_dir, *evaluator, *TRAIN]) == 0


def _export_is_the_checkpoint_format(run: str, model_dir: str) -> None:
    """The export holds the base's tensors (names, dtypes, shapes, quantization_config) with the center's codes."""
    exported, base = tensors(os.path.join(run, "export")), tensors(model_dir)
    assert exported.keys() == base.keys()
    assert all(exported[k].dtype == base[k].dtype and exported[k].shape == base[k].shape for k in base)
    with open(os.path.join(run, "export", "config.json"), encoding="utf-8") as f:
        qc = json.load(f)["quantization_config"]
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        assert qc == json.load(f)["quantization_config"]
    center, _ = runs.load_center(os.path.join(run, runs.CENTER))
    codes, orders = checkpoint_codes(os.path.join(run, "export")), act_orders(model_dir)  # act-order: columns grouped
    assert all(torch.equal(codes[k][:, orders.get(k, slice(None))], master_codes(center[k]).int()) for k in codes)
    assert all(center[k].dtype == torch.int16 for k in codes)  # residual8 masters: 2 B per weight on disk
    assert any(not torch.equal(codes[k], checkpoint_codes(model_dir)[k]) for k in codes)  # it trained
    unchanged = ("_scale", "_zero_point", "_shape", ".scales", ".qzeros", ".g_idx")
    assert all(torch.equal(exported[k], base[k]) for k in base if k.endswith(unchanged))


def _vllm_generates(export: str) -> None:
    from vllm import SamplingParams

    from espert.vllm import make_llm
    from espert.vllm.driver.evaluator import shutdown_llm

    llm = make_llm(export, max_model_len=64, multiprocess=False)
    try:
        out = llm.generate([[1, 4, 5]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        shutdown_llm(llm)


def _loads_and_generates(export: str) -> None:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(export)
    assert m.generate(torch.tensor([[1, 4, 5]]), max_new_tokens=3, do_sample=False).shape == (1, 6)


@pytest.mark.parametrize(
    "scheme,arch", [("W4A16", "qwen2")] + ([("W4A16", "llama"), ("W8A8", "llama")] if SLOW else [])
)
def test_vllm_trains_exports_in_the_checkpoint_format_and_replays(checkpoint_of, scheme, arch, tmp_path, capsys):
    """Through vLLM (a Qwen2 in CI: its q/k/v biases are float tensors of an int4 layer), exported in the checkpoint's
    format, loaded back by transformers and vLLM, and replayed in torch bit for bit."""
    pytest.importorskip("vllm")
    d = checkpoint_of(scheme, arch)
    run = str(tmp_path / "run")
    _train(d, run, "--evaluator", "vllm")
    _export_is_the_checkpoint_format(run, d)
    if arch == "qwen2":  # the int4 layers' float biases are in the center, under their checkpoint names
        center, _ = runs.load_center(os.path.join(run, runs.CENTER))
        assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.1.self_attn.v_proj.bias"} <= set(center)
    _loads_and_generates(os.path.join(run, "export"))
    capsys.readouterr()
    assert main(["replay", run, "--out", str(tmp_path / "replay")]) == 0  # torch, from the base
    assert "bit-identical" in (err := capsys.readouterr().err) and ": yes" in err, err
    _vllm_generates(os.path.join(run, "export"))


@pytest.mark.parametrize("scheme", ["W8A8"] + W4[:1] + (W4[1:] if SLOW else []))
def test_torch_trains_the_codes_exports_in_the_checkpoint_format_and_resumes(checkpoint_of, scheme, tmp_path):
    d = checkpoint_of(scheme)
    run, half = str(tmp_path / "run"), str(tmp_path / "half")
    _train(d, run)
    _export_is_the_checkpoint_format(run, d)
    _loads_and_generates(os.path.join(run, "export"))
    assert main(["train", "--run-dir", half, "--model", d, *TRAIN, "--iterations", "1"]) == 0
    assert main(["train", "--run-dir", half, "--resume", "--iterations", "2", "--no-progress"]) == 0
    a, b = (runs.load_center(os.path.join(r, runs.CENTER))[0] for r in (run, half))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("evaluator", ["torch", "vllm"])
@pytest.mark.parametrize("case", ["int3 (a malformed config)", "FP8_DYNAMIC"])
def test_a_scheme_espert_cannot_edit_is_refused_in_one_line_with_nothing_written(
    checkpoint_of, case, evaluator, tmp_path, capsys
):
    if evaluator == "vllm":
        pytest.importorskip("vllm")
    if case == "FP8_DYNAMIC":
        d = checkpoint_of(case)
    else:  # llm-compressor's W4A16 with num_bits edited to 3
        import shutil

        d = str(tmp_path / "int3")
        shutil.copytree(checkpoint_of("W4A16"), d)
        with open(os.path.join(d, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 3
        with open(os.path.join(d, "config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f)
    run = str(tmp_path / "run")
    assert main(["train", "--run-dir", run, "--model", d, "--evaluator", evaluator, *TRAIN]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "compressed-tensors scheme" in errors[0], errors
    assert ("int3" if case.startswith("int3") else "float-quantized float8 channel") in errors[0], errors[0]
    assert "group_0" in errors[0] and "['Linear']" in errors[0]  # the scheme's group and the layers it covers
    assert not os.path.exists(run)


@gptqmodel
@pytest.mark.parametrize("scheme", ["GPTQ", pytest.param("AutoAWQ", marks=autoawq)] + (["AWQ"] if SLOW else []))
def test_gptq_and_awq_train_to_one_center_in_both_evaluators_and_export_in_their_format(
    checkpoint_of, scheme, tmp_path, capsys
):
    """GPTQModel's and AutoAWQ's checkpoints train through vLLM and through torch (its QuantLinears hold the stored words) to the
    same center bit for bit; the export is the checkpoint's format (qweight words, scales, qzeros, g_idx), replays
    bit for bit, and loads and generates in vLLM and in transformers (through GPTQModel's kernels, in a child)."""
    pytest.importorskip("vllm")
    d = checkpoint_of(scheme)
    (run_vllm, run_torch) = (str(tmp_path / r) for r in ("vllm", "torch"))
    _train(d, run_vllm, "--evaluator", "vllm")
    _train(d, run_torch)
    a, b = (runs.load_center(os.path.join(r, runs.CENTER))[0] for r in (run_vllm, run_torch))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    _export_is_the_checkpoint_format(run_vllm, d)
    capsys.readouterr()
    assert main(["replay", run_vllm, "--out", str(tmp_path / "replay")]) == 0  # torch, from the base
    assert "bit-identical" in (err := capsys.readouterr().err) and ": yes" in err, err
    tokens, _ = compressed.transformers_outputs(os.path.join(run_vllm, "export"))
    assert tokens[:3] == [1, 4, 5] and len(tokens) == 6
    _vllm_generates(os.path.join(run_vllm, "export"))


@gptqmodel
@pytest.mark.parametrize(
    "scheme",
    ["GPTQ-actorder", pytest.param("AutoAWQ", marks=autoawq)]
    + (["GPTQ", "GPTQ-actorder-channel", "AWQ"] if SLOW else []),
)
def test_espert_computes_what_gptqmodel_computes_from_the_checkpoint(checkpoint_of, scheme):
    """espert's loader (QuantLinear over the stored words; act-order's scales through g_idx) gives the logits that
    transformers gives through GPTQModel's kernels, to their float16 rounding.  Reading act-order's scales by
    ``k // group`` instead is off by 22% of the largest logit; this is 0.4%."""
    d = checkpoint_of(scheme)
    _, theirs = compressed.transformers_outputs(d)
    with torch.no_grad():
        model = load_packed_model(d, torch.float32, weight_scheme(quantization_config(d)))
        ours = model(torch.tensor(compressed.PROMPT)).logits
    assert (ours - theirs).abs().max() < 0.02 * theirs.abs().max()


@gptqmodel
def test_gptq_act_order_trains_in_torch_exports_in_its_format_and_vllm_refuses_it_in_one_line(
    checkpoint_of, tmp_path, capsys
):
    """GPTQModel's act-order checkpoint (desc_act with groups, a permuted g_idx): vLLM refuses to load it ("no longer
    supported"), so espert refuses ``--evaluator vllm`` in one line before anything is written; torch trains it,
    exports its format (g_idx unchanged), replays bit for bit, and transformers loads and generates the export."""
    d = checkpoint_of("GPTQ-actorder")
    if importlib.util.find_spec("vllm") is not None:
        run = str(tmp_path / "vllm")
        assert main(["train", "--run-dir", run, "--model", d, "--evaluator", "vllm", *TRAIN]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(errors) == 1 and "GPTQ gptq int4 group 32 sym, act-order: vLLM no longer loads" in errors[0]
        assert not os.path.exists(run)
    run = str(tmp_path / "torch")
    _train(d, run)
    _export_is_the_checkpoint_format(run, d)
    capsys.readouterr()
    assert main(["replay", run, "--out", str(tmp_path / "replay")]) == 0
    assert "bit-identical" in (err := capsys.readouterr().err) and ": yes" in err, err
    tokens, _ = compressed.transformers_outputs(os.path.join(run, "export"))
    assert tokens[:3] == [1, 4, 5] and len(tokens) == 6


@pytest.mark.parametrize(
    "scheme", [pytest.param("GPTQ-actorder", marks=gptqmodel), "W4A16-asym"] + (["W8A8", "AutoAWQ"] if SLOW else [])
)
def test_a_float_export_is_written_on_request_and_computes_what_the_quantized_export_does(
    checkpoint_of, scheme, tmp_path
):
    """``export_dtype`` other than ``base`` asks for a float model: the trained codes dequantized with the
    checkpoint's scales and zero points (act-order's columns back in their order), no quantization config.  Plain
    transformers loads it, and its logits are those of the quantized export as the ecosystem loads it
    (transformers for compressed-tensors, GPTQModel's kernels for GPTQ and AWQ), to their half-precision rounding."""
    from transformers import AutoModelForCausalLM

    from espert.runs.export import export_model
    from espert.tensorfile import FileChunks

    if scheme == "AutoAWQ" and not compressed.has_autoawq():
        pytest.skip("AutoAWQ is not in .venv/quantizers")
    d, run = checkpoint_of(scheme), str(tmp_path / "run")
    _train(d, run)
    out = export_model(FileChunks(os.path.join(run, runs.CENTER)), d, str(tmp_path / "float"), dtype="float32")
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
        assert "quantization_config" not in json.load(f)
    stored = tensors(out)
    assert all(t.dtype == torch.float32 for t in stored.values()) and not any("qweight" in k for k in stored)
    with torch.no_grad():
        ours = AutoModelForCausalLM.from_pretrained(out)(torch.tensor(compressed.PROMPT)).logits
        if scheme.startswith(("W4A16", "W8A8")):
            theirs = AutoModelForCausalLM.from_pretrained(os.path.join(run, "export"), dtype=torch.float32)
            theirs = theirs(torch.tensor(compressed.PROMPT)).logits
        else:
            _, theirs = compressed.transformers_outputs(os.path.join(run, "export"))
    assert (ours - theirs).abs().max() < 0.02 * theirs.abs().max()
