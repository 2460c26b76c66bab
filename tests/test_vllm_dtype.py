"""``--dtype auto`` on vLLM means the checkpoint's dtype, or one vLLM-CPU's packed GEMMs take, chosen by espert.

vLLM's own ``auto`` downcasts a float32 checkpoint to bfloat16 on a CPU (99 "Attempted to load weight
... float32 into parameter with dtype torch.bfloat16" lines for a 0.5 B model); on a CPU without bf16
matmuls oneDNN then refuses every layer and generation falls back to torch matmuls ("Failed to create
oneDNN linear"), 0 of 32 HumanEval samples in 40 minutes.
"""

import logging

import pytest
import torch

pytest.importorskip("vllm")


def _gemm_paths(worker):
    """``{layer name: "packed" | "torch"}`` of every unquantized Linear of the engine's model: vLLM-CPU's
    packed kernels (oneDNN or SGL) close over their packed weight; its fallback is a bare F.linear lambda."""
    out = {}
    for name, mod in worker.model_runner.model.named_modules():
        fn = getattr(mod, "cpu_linear", None)
        if fn is None or name.endswith("embed_tokens"):
            continue
        inner = getattr(fn, "packed", fn)  # espert's repacking wrapper holds vLLM's closure
        out[name] = "packed" if getattr(inner, "__closure__", None) else "torch"
    return out


def _param_dtypes(worker):
    return sorted({str(p.dtype) for p in worker.model_runner.model.parameters()})


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_auto_dtype_of_a_float32_checkpoint_keeps_float32_and_the_packed_path(tiny_dir, monkeypatch, capsys):
    """``espert eval --evaluator vllm`` with the default ``--dtype auto`` on the float32 tiny model: the engine
    runs float32 (no conversion warnings), its 9 Linear layers (2 x qkv, o, gate_up, down; lm_head) on vLLM's packed path, and the choice is said once."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from espert.eval.samplers import make_sampler

    rec = _Records()
    logging.getLogger("vllm").addHandler(rec)
    try:
        s = make_sampler("vllm", tiny_dir, dtype="auto", max_model_len=64)
    finally:
        logging.getLogger("vllm").removeHandler(rec)
    try:
        assert s.llm.llm_engine.model_config.dtype == torch.float32
        assert s.llm.collective_rpc(_param_dtypes)[0] == ["torch.float32"]
        paths = s.llm.collective_rpc(_gemm_paths)[0]
        assert len(paths) == 9 and set(paths.values()) == {"packed"}, paths
        assert not [m for m in rec.lines if "Attempted to load weight" in m or "Downcasting" in m]
        assert not [m for m in rec.lines if "Failed to create oneDNN linear" in m]
        said = [line for line in capsys.readouterr().err.splitlines() if "vLLM dtype" in line]
        assert len(said) == 1 and "float32" in said[0] and "checkpoint" in said[0], said
    finally:
        s.close()


def test_auto_dtype_rule(tiny_dir, tmp_path, monkeypatch):
    """The rule, without an engine: the checkpoint's dtype where vLLM-CPU packs it, else float32 (a bf16
    checkpoint on a CPU without bf16 matmuls); a dtype given explicitly is passed through."""
    import json
    import shutil

    from espert.vllm.driver import evaluator

    assert evaluator.resolve_dtype(tiny_dir, "bfloat16")[0] == "bfloat16"
    assert evaluator.resolve_dtype(tiny_dir, "auto")[0] == "float32"
    bf16 = tmp_path / "bf16"
    shutil.copytree(tiny_dir, bf16)
    cfg = json.loads((bf16 / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = "bfloat16"
    (bf16 / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(evaluator, "_on_cpu", lambda: True)
    monkeypatch.setattr(evaluator, "cpu_packs", lambda dtype: (True, ""))
    assert evaluator.resolve_dtype(str(bf16), "auto")[0] == "bfloat16"
    monkeypatch.setattr(evaluator, "cpu_packs", lambda dtype: (dtype == torch.float32, "no bf16 matmul on this CPU"))
    dtype, why = evaluator.resolve_dtype(str(bf16), "auto")
    assert dtype == "float32" and "no bf16 matmul" in why
