"""A population over two vLLM engines in Ray actors vs one engine.

- two engines give the same rewards, extracted answers and final center as one engine (bitwise);
- replicas compare checksums at every update and stop loudly on divergence;
- a dead engine's members are re-queued on a live one, not lost: an engine process dies in the
  middle of scoring (os._exit), and later the last one is killed with ray.kill (the pool raises);
  this pool does not replace engines (``replace=False``; replacement, hangs, node loss and added
  engines: tests/test_vllm_cluster.py);
- batched members (lowrank:2 as LoRA adapters) over two engines equal one batched engine.
Runtime: ~1 min (two actors start an engine each, twice).
"""

import os
import sys

import pytest

vllm = pytest.importorskip("vllm")
ray = pytest.importorskip("ray")

import torch  # noqa: E402

from espert.es import coefficients, normalize  # noqa: E402
from espert.tasks import load_task  # noqa: E402
from espert.tensorfile import write_chunks, write_safetensors  # noqa: E402
from espert.update import Update  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
TASK = load_task("copy", "train", n=12)


class CrashOnce:
    """The task's score, except that the first engine to find ``path`` deletes it and dies on the spot."""

    def __init__(self, path, score):
        self.path, self.score = path, score

    def __call__(self, completions, answers):
        try:
            os.remove(self.path)
        except FileNotFoundError:
            return self.score(completions, answers)
        os._exit(1)


@pytest.fixture(scope="module")
def single(tiny_dir):
    from espert.vllm import VLLMEvaluator, make_llm
    from espert.vllm.driver.evaluator import shutdown_llm

    e = VLLMEvaluator(
        make_llm(tiny_dir, max_model_len=64, multiprocess=False), TASK.score, max_new_tokens=6, extract=TASK.extract
    )
    yield e
    shutdown_llm(e.llm)


@pytest.fixture(scope="module")
def crash_file(tmp_path_factory):
    return str(tmp_path_factory.mktemp("crash") / "crash_once")


@pytest.fixture(scope="module")
def pool(tiny_dir, crash_file):
    from espert.vllm import EnginePool

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors cannot import tests/
    p = EnginePool(
        tiny_dir,
        CrashOnce(crash_file, TASK.score),
        engines=2,
        replace=False,
        max_new_tokens=6,
        extract=TASK.extract,
        llm_kwargs=dict(max_model_len=64),
        ray_init=dict(address="local", num_cpus=2, object_store_memory=128 << 20),
    )
    yield p
    p.close()
    ray.shutdown()


@pytest.fixture(autouse=True)
def one_thread(set_torch_threads):
    """The in-process engine on one thread, as each actor (OMP_NUM_THREADS=1): a random-init model's
    near-tie logits make greedy tokens follow the reduction order."""
    set_torch_threads(1)


def exact(cs):
    from espert.vllm.wire import exact_fields

    return exact_fields(cs)


def members(t):
    return [(1000 * t + k, g) for k in range(4) for g in (1, -1)]


def test_two_engines_equal_one_engine(pool, single, tmp_path):
    for t in (1, 2):
        m = members(t)
        r_pool = pool.evaluate(m, 0.05, TASK.prompts, TASK.answers)
        r_one = single.evaluate(m, 0.05, TASK.prompts, TASK.answers)
        assert r_pool == r_one
        assert pool.member_answers == single.member_answers and len(pool.member_answers) == len(m)
        seeds, coeffs = coefficients(m, r_one, normalize(r_one), 0.02)
        assert seeds
        pool.update(Update(seeds, coeffs, 0.999))
        single.update(Update(seeds, coeffs, 0.999))
        # only seeds, scalars and checksums travelled: a few hundred bytes against 4 B/parameter
        assert sum(pool.traffic.values()) < 4096 < pool.weights_bytes
    assert pool.checksums and all(len(c) == 2 for c in pool.checksums)
    got, want = pool.center_state(), single.center_state()
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert exact(pool.checksum()[0]) == exact(single.checksum())
    # checkpoints stream from one engine in bounded chunks: the same file as the single engine's center
    pool.chunk_bytes = 4096
    a, b = str(tmp_path / "pool.safetensors"), str(tmp_path / "one.safetensors")
    assert write_chunks(a, pool.center_stream()) == write_safetensors(b, want)


def test_divergence_stops_loudly(pool):
    from espert.vllm.driver.pool import ReplicaDivergence

    ray.get(pool.actors[1].rpc.remote("es_update", [99], [0.1], 1.0))  # one replica drifts
    with pytest.raises(ReplicaDivergence, match="engine 1"):
        pool.checksum()


def test_engine_dying_mid_iteration_loses_no_member(pool, single, crash_file, tmp_path):
    pool.load_center(single.center_state())  # resynchronise the drifted replica (the one call that ships weights)
    assert len(pool.checksums[-1]) == 2
    open(crash_file, "w").close()  # the next engine to score a chunk dies in the middle of it
    m = members(3)
    assert pool.evaluate(m, 0.05, TASK.prompts, TASK.answers) == single.evaluate(m, 0.05, TASK.prompts, TASK.answers)
    assert pool.member_answers == single.member_answers  # the re-queued chunk's answers too
    assert not os.path.exists(crash_file) and len(pool.dead) == 1 and len(pool.alive) == 1
    pool.update(Update([5], [0.01]))
    single.update(Update([5], [0.01]))
    assert exact(pool.checksum()[pool.alive[0]]) == exact(single.checksum())
    a, b = str(tmp_path / "pool.safetensors"), str(tmp_path / "one.safetensors")
    assert write_chunks(a, pool.center_stream()) == write_safetensors(b, single.center_state())


def test_losing_every_engine_raises(pool):
    ray.kill(pool.actors[pool.alive[0]])
    with pytest.raises(RuntimeError, match="every engine"):
        pool.evaluate(members(4), 0.05, TASK.prompts, TASK.answers)


@pytest.mark.extended  # ESPERT_SLOW=1 (~2 min under load): by default the pool is checked by
# test_two_engines_equal_one_engine and batched LoRA members by tests/test_vllm_lora.py
def test_two_batched_engines_equal_one_batched_engine(tiny_dir):
    """Issue 23's batched members (lowrank:2 as LoRA adapters) over an EnginePool: two engines give one
    engine's rewards and answers, and the centers stay equal through updates.  After the tests above
    both of the first pool's actors are dead, so their CPUs are free for two new ones."""
    from espert.vllm import EnginePool, VLLMEvaluator

    kw = dict(noise="lowrank:2", members="batched", max_loras=4, max_new_tokens=6, extract=TASK.extract)
    single = VLLMEvaluator(tiny_dir, TASK.score, llm_kwargs=dict(max_model_len=64, multiprocess=False), **kw)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    pool = EnginePool(
        tiny_dir,
        TASK.score,
        engines=2,
        llm_kwargs=dict(max_model_len=64),
        ray_init=dict(address="local", num_cpus=2, object_store_memory=128 << 20),
        **kw,
    )
    try:
        assert single.lora_slots == 4  # both sides really are batched: 4 pinned LoRA slots per engine
        assert [ray.get(a.rpc.remote("es_lora_slots")) for a in pool.actors] == [[4], [4]]
        for t in (1, 2):
            m = members(t)
            r_pool = pool.evaluate(m, 0.3, TASK.prompts, TASK.answers)
            r_one = single.evaluate(m, 0.3, TASK.prompts, TASK.answers)
            assert r_pool == r_one and pool.member_answers == single.member_answers
            seeds, coeffs = coefficients(m, r_one, normalize(r_one), 0.02)
            pool.update(Update(seeds, coeffs, 0.999))
            single.update(Update(seeds, coeffs, 0.999))
        got, want = pool.center_state(), single.center_state()
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
        assert exact(pool.checksum()[0]) == exact(single.checksum())
    finally:
        pool.close()
        single.close()
