"""Mixtures of experts (issue 51): every expert and the router keyed by its checkpoint name, in transformers' fused
layout and in vLLM's, exported and replayed in the checkpoint's own format.

The models are built by transformers (tests/fixtures/tiny_model.py: Qwen3-MoE, Mixtral and Qwen2-MoE, 8 experts,
top-2) and
written by its ``save_pretrained``; transformers 5 fuses their experts at load (``experts.gate_up_proj
[E, 2I, H]``), vLLM fuses them its own way (``w13_weight``, ``w2_weight``, prepacked on vLLM-CPU).  Before this:

- ``espert train`` (torch) keyed the noise by transformers' fused names and failed at the export, after its last
  iteration: ``the base checkpoint ... has no tensors named ['model.layers.0.mlp.experts.down_proj', ...]``;
- through vLLM, ``es_setup`` refused the router (``GateLinear``) and every expert weight.
"""

from __future__ import annotations

import os
import textwrap

import pytest
import torch
from fixtures.tiny_model import MOE_ARCHS as FAMILIES
from fixtures.tiny_model import build_tiny_model
from safetensors import safe_open

from espert import runs
from espert.cli import main

TRAIN = [
    "--iterations", "2", "--population", "2", "--prompts-per-iteration", "2", "--max-new-tokens", "3",
    "--eval-size", "2", "--train-size", "8", "--no-progress",
]  # fmt: skip


@pytest.fixture(scope="module", params=FAMILIES)
def moe_dir(request, tmp_path_factory):
    return build_tiny_model(arch=request.param, save_dir=str(tmp_path_factory.mktemp(request.param) / "model"))


def checkpoint(d: str) -> dict[str, torch.Tensor]:
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_torch_views_are_the_checkpoint_tensors(moe_dir):
    """Each view has a checkpoint name and holds that tensor, as a view into transformers' fused parameter; the
    names and values are those of transformers' own reverse conversion (what save_pretrained writes)."""
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    from espert.params import torch_param_views

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    fused = {n: p for n, p in model.named_parameters() if "experts" in n}
    assert fused and all(p.dim() == 3 for p in fused.values())  # transformers fused them
    views = torch_param_views(model)
    ck = checkpoint(moe_dir)
    assert [v.name for v in views if v.name not in ck] == [] and len(views) == len(ck)
    reverted = revert_weight_conversion(model, {n: p.detach() for n, p in model.named_parameters()})
    storages = {p.untyped_storage().data_ptr() for p in fused.values()}
    for v in views:
        assert torch.equal(v.tensor, ck[v.name]) and torch.equal(v.tensor, reverted[v.name]), v.name
        if ".experts." in v.name:
            assert v.tensor.untyped_storage().data_ptr() in storages, v.name  # a view, edited in place


def _train_export_replay(model_dir: str, tmp_path, capsys, *evaluator: str) -> str:
    """Train 2 iterations, then check the export (the checkpoint's names and shapes, the center's values; experts
    and router moved when an iteration took a step)
    and a replay (bit-identical center); returns the run directory."""
    run = str(tmp_path / "run")
    assert main(["train", "--run-dir", run, "--model", model_dir, *evaluator, *TRAIN]) == 0
    exported, base = checkpoint(os.path.join(run, "export")), checkpoint(model_dir)
    assert exported.keys() == base.keys() and all(exported[k].shape == base[k].shape for k in base)
    center, _ = runs.load_center(os.path.join(run, runs.CENTER))
    assert center.keys() == base.keys()  # every expert and the router, under checkpoint names
    assert all(torch.equal(exported[k], center[k].to(base[k].dtype)) for k in base)
    stepped = any(not r.get("zero_spread") for r in runs.read_log(os.path.join(run, runs.LOG)) if r["kind"] == "iter")
    moved = [k for k in base if not torch.equal(exported[k], base[k])]
    assert not stepped or (any(".experts.0." in k for k in moved) and any(k.endswith("gate.weight") for k in moved))
    capsys.readouterr()
    assert main(["replay", run, "--out", str(tmp_path / "replay")]) == 0
    assert "bit-identical" in (err := capsys.readouterr().err) and ": yes" in err, err
    return run


def test_train_exports_in_the_checkpoint_format_resumes_and_replays(moe_dir, tmp_path, capsys):
    run = _train_export_replay(moe_dir, tmp_path, capsys)
    # a run stopped after iteration 1 and resumed ends with the same center
    half = str(tmp_path / "half")
    assert main(["train", "--run-dir", half, "--model", moe_dir, *TRAIN, "--iterations", "1"]) == 0
    assert main(["train", "--run-dir", half, "--resume", "--iterations", "2", "--no-progress"]) == 0
    a, b = (runs.load_center(os.path.join(d, runs.CENTER))[0] for d in (run, half))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the export loads in transformers and generates
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(os.path.join(run, "export"))
    assert m.generate(torch.tensor([[1, 4, 5]]), max_new_tokens=3, do_sample=False).shape == (1, 6)


def test_vllm_evaluator_trains_exports_and_replays(tmp_path, capsys):
    """``espert train --evaluator vllm`` on a Qwen3-MoE: the export in the checkpoint's names, and a replay (torch,
    from the base) bit-identical to the center the vLLM workers kept."""
    pytest.importorskip("vllm")
    _train_export_replay(
        build_tiny_model(arch="qwen3_moe", save_dir=str(tmp_path / "m")), tmp_path, capsys, "--evaluator", "vllm"
    )


def test_a_run_that_cannot_export_is_refused_before_its_first_iteration(tmp_path, capsys):
    """A checkpoint transformers loads but espert cannot write in its format (``pytorch_model.bin``): refused at
    setup, with nothing written; before, it trained every iteration and failed at the export."""
    from safetensors.torch import load_file

    d = build_tiny_model(arch="qwen3_moe", save_dir=str(tmp_path / "bin"))
    torch.save(load_file(os.path.join(d, "model.safetensors")), os.path.join(d, "pytorch_model.bin"))
    os.remove(os.path.join(d, "model.safetensors"))
    run = str(tmp_path / "run")
    capsys.readouterr()
    assert main(["train", "--run-dir", run, "--model", d, *TRAIN]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if not ln.startswith("[espert]")]  # status lines
    assert len(err) == 1 and "no *.safetensors weights" in err[0] and "nothing was written" in err[0], err
    assert not os.path.exists(run)


ENGINE = textwrap.dedent("""
    import json, sys
    import torch
    from vllm import LLM, SamplingParams
    from espert.vllm.wire import assemble
    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=64, seed=0, enable_prefix_caching=False,
              enforce_eager=sys.argv[3] == "eager", worker_extension_cls="espert.vllm.worker.ESWorkerExtension")
    runner = llm.collective_rpc(lambda w: type(w.model_runner).__module__)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 4, 5, 6, 10]}, {"prompt_token_ids": [1, 7, 8]}]
    gen = lambda: [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
    live = lambda: assemble(llm.collective_rpc("es_live_state"))
    info = llm.collective_rpc("es_setup")[0]
    base, w0 = gen(), live()
    llm.collective_rpc("es_perturb", args=(7, 0.05))
    perturbed, w1 = gen(), live()
    llm.collective_rpc("es_restore")
    restored, w2 = gen(), live()
    torch.save({"perturbed": w1}, sys.argv[2])
    print("RESULT" + json.dumps({"runner": runner, "self_test": info["self_test"], "params": info["params"], "base": base,
        "perturbed": perturbed, "restored": restored, "exact": all(torch.equal(w0[k], w2[k]) for k in w0)}))
""")


ENGINES = [
    ("qwen3_moe", "v1", "eager"),
    ("mixtral", "v1", "eager"),
    ("qwen2_moe", "v1", "eager"),  # a shared expert and its gate beside the routed experts
    ("qwen3_moe", "v2", "eager"),
    ("qwen3_moe", "v1", "compiled"),
    *[
        pytest.param(*c, marks=pytest.mark.extended)
        for c in [("mixtral", "v2", "eager"), ("mixtral", "v1", "compiled")]
    ],
]


@pytest.mark.parametrize("family,runner,mode", ENGINES)
def test_vllm_perturbs_every_expert_as_torch_does(family, runner, mode, tmp_path):
    """Through vLLM (V1 or V2 model runner, eager or compiled): the router and every expert under checkpoint names,
    the self-test probes an expert tensor, a perturbation changes the tokens and its restore is exact, and each
    expert's noise is bit-identical to transformers' (torch evaluator) for the same member."""
    pytest.importorskip("vllm")
    from fixtures.engine_script import run_engine_script
    from transformers import AutoModelForCausalLM

    from espert.center import CenterStore
    from espert.params import torch_param_views

    d = build_tiny_model(arch=family, save_dir=str(tmp_path / family))
    out = str(tmp_path / "live.pt")
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_USE_V2_MODEL_RUNNER", "ESPERT_VLLM_RUNNER")}
    env["VLLM_CACHE_ROOT"] = str(tmp_path / "cache")
    prelude = ""
    if runner == "v2":
        fixtures = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
        prelude = f"import sys; sys.path.insert(0, {fixtures!r}); import v2_runner; v2_runner.enable()\n"
    res = run_engine_script(prelude + ENGINE, d, out, mode, env=env, timeout=500)
    assert ("worker.gpu" in res["runner"] or ".cpu.model_runner" in res["runner"]) == (runner == "v2"), res["runner"]
    assert sorted(res["params"]) == sorted(checkpoint(d)), sorted(set(res["params"]) ^ set(checkpoint(d)))[:4]
    assert any(".experts." in n for n in res["self_test"]), res["self_test"]
    assert res["perturbed"] != res["base"] and res["restored"] == res["base"] and res["exact"]
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    center = CenterStore(torch_param_views(model), master_dtype=torch.float32)
    center.perturb(7, 0.05)
    theirs = torch.load(out)["perturbed"]
    mine = {v.name: v.tensor for v in center.views}
    assert mine.keys() == theirs.keys()
    differ = [k for k in mine if not torch.equal(mine[k], theirs[k])]
    assert differ == [], differ[:4]


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_sharded_expert_noise_equals_the_checkpoint_tensors_noise(tp, ep):
    """vLLM's expert layout under tensor parallelism (each expert's intermediate dimension split) and expert
    parallelism (experts placed across ranks, here the second half first), with shards built by hand as vLLM's
    loader fills them: every rank's pieces, perturbed, equal the perturbed checkpoint tensors, and reassemble."""
    from espert.center import CenterStore
    from espert.ops import perturb_
    from espert.params import ParamView
    from espert.vllm.engine.params import expert_pieces, piece_views
    from espert.vllm.wire import assemble, block_to_tuple, pack_tensor

    E, I, H = 4, 8, 6
    gen = torch.Generator().manual_seed(tp * 10 + ep)
    names = {
        (e, s): f"mlp.experts.{e}.{p}.weight"
        for e in range(E)
        for s, p in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
    }
    full = {n: torch.randn((H, I) if ".down_proj" in n else (I, H), generator=gen) for n in names.values()}
    want = {n: t.clone() for n, t in full.items()}
    for n, t in want.items():
        perturb_(t, 99, ParamView(n, t).key, 0.1, 1)
    placement = [[2, 3], [0, 1]] if ep == 2 else [[0, 1, 2, 3]]
    pieces = []
    for r_ep in range(ep):
        for rank in range(tp):
            local, p = placement[r_ep], I // tp
            part = slice(rank * p, (rank + 1) * p)
            w13 = torch.stack([torch.cat([full[names[g, "w1"]][part], full[names[g, "w3"]][part]]) for g in local])
            w2 = torch.stack([full[names[g, "w2"]][:, part] for g in local]).contiguous()
            views = []
            for leaf, t in (("w13_weight", w13), ("w2_weight", w2)):
                ps = expert_pieces(leaf, t.shape, names, local_experts=local, intermediate=I, tp_rank=rank, tp_size=tp)
                views += piece_views(t.reshape(-1, t.shape[-1]), ps)
            CenterStore(views).perturb(99, 0.1, 1)
            for k, g in enumerate(local):  # the live shards are the perturbed checkpoint tensors' shards
                assert torch.equal(w13[k], torch.cat([want[names[g, "w1"]][part], want[names[g, "w3"]][part]]))
                assert torch.equal(w2[k], want[names[g, "w2"]][:, part])
            pieces.append([(v.name, pack_tensor(v.tensor), block_to_tuple(v.block)) for v in views])
    got = assemble(pieces)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_expert_layouts_espert_cannot_map_are_refused_naming_the_parameter():
    from espert.vllm.engine.params import LayoutError, expert_pieces

    names = {(e, s): f"e{e}.{s}" for e in range(2) for s in ("w1", "w2", "w3")}
    with pytest.raises(LayoutError, match="w13_weight: shape .2, 20, 6. is not 2×8"):  # padded to 10 per shard
        expert_pieces("x.w13_weight", (2, 20, 6), names, local_experts=[0, 1], intermediate=8)
    with pytest.raises(LayoutError, match="x.w2_weight: 2 local experts, 1 placed"):
        expert_pieces("x.w2_weight", (2, 6, 8), names, local_experts=[0], intermediate=8)


BATCHED = textwrap.dedent("""
    import json, sys
    from vllm import LLM
    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=64, enforce_eager=True, enable_lora=True,
              max_lora_rank=8, max_loras=2, worker_extension_cls="espert.vllm.worker.ESWorkerExtension")
    try:
        llm.collective_rpc("es_setup", kwargs={"members": "batched", "noise": "lowrank:1"})
        refused = None
    except Exception as e:
        refused = str(e).strip().splitlines()[-1]
    print("RESULT" + json.dumps({"refused": refused}))
""")


def test_batched_members_are_refused_on_experts_in_one_line(tmp_path):
    """vLLM LoRA members (``vllm_members: batched``) carry Linear layers only; on a MoE espert refuses them
    naming the expert layer, instead of training a center whose experts never move."""
    pytest.importorskip("vllm")
    from fixtures.engine_script import run_engine_script

    res = run_engine_script(BATCHED, build_tiny_model(arch="qwen3_moe", save_dir=str(tmp_path / "m")))
    assert res["refused"] and "model.layers.0.mlp.experts" in res["refused"], res
    assert "vllm_members: serial" in res["refused"]


@pytest.mark.parametrize("runner", ["v1", pytest.param("v2", marks=pytest.mark.extended)])
def test_the_drop_in_sequence_on_a_mixture_of_experts(runner, tmp_path):
    """ES-at-Scale's calls through espert's drop-in (``save_self_initial_weights``, ``perturb_self_weights``,
    ``restore_self_weights``) on a Qwen3-MoE: the tokens change, and the restore gives the base's tokens back.
    Before, the first call raised LayoutError on the router (GateLinear)."""
    pytest.importorskip("vllm")
    from test_vllm_runners import _drop_in

    res = _drop_in(
        build_tiny_model(arch="qwen3_moe", save_dir=str(tmp_path / "m")), tmp_path, runner, {"enforce_eager": True}
    )
    assert res["perturbed"] != res["base"] and res["restored"] == res["base"], res
