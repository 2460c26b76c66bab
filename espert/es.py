"""The ES loop: one config object, a step that fits on a screen, and a resumable training run.

The step (``es_step``), with N members, antithetic pairs sharing a seed::

    σ_t, α_t   = schedules at iteration t
    members    = [(s_k, +1), (s_k, -1) for k < N/2]        s_k = member_seed(seed, t, k)
    r_n        = evaluator.evaluate(members, σ_t, prompts_t)  mean task reward of θ + sign_n·σ_t·ε(s_n)
    z_n        = normalize(r)                                 over valid members (nan = failed, dropped)
    c_k        = α_t / N_valid · Σ_{n: seed s_k} sign_n·z_n   one coefficient per seed
    θ         <- (1 - α_t·wd)·θ + Σ_k c_k·ε(s_k)              fused, on the float32 master

so θ ← θ + α·(1/N)·Σ z_n ε_n exactly as in ES-at-Scale (Qiu et al. 2025): **we do not divide by
σ** (the gradient estimate is (1/(Nσ))·Σ z_n ε_n, so α here plays the role of lr·σ; the seed
papers use α = σ/2).  Noise never exists as a tensor: perturbation and update regenerate
ε(seed, key, index) inside the kernels.  Everything that moves θ is logged before it is applied
(seeds, coefficients, decay), so a run is replayable from the base model and its log alone.

Failure rule: a member whose reward is nan or infinite (failed rollout) is dropped; z-scores/ranks are
computed over the valid members and N_valid divides the sum.  All valid rewards equal → zero
update (no nan).  No valid member → the update (and the decay) is skipped and the record says so.

Derived randomness (all pure functions of ``ESConfig.seed``, documented for other implementations)::

    derive_seed(tag, master, t, j) = uint64 little-endian of sha256(f"espert/{tag}/{master}/{t}/{j}")[:8]
    member_seed(master, t, k)      = derive_seed("member", master, t, k)
    prompt_indices(t)              = random.Random(derive_seed("prompts", master, t, 0)).sample(range(pool), P)
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
import time
import typing
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from espert.evaluators import Evaluator, Member

U64 = 1 << 64
NORMALIZATIONS = ("zscore", "rank")
SCHEDULES = ("constant", "linear", "cosine")


@dataclass
class ESConfig:
    """Everything a run needs; the single object that flows from the CLI (or a YAML/TOML file) to the loop.

    Defaults are the main job: the tiny model from random init, the ``copy`` task, CPU, a few minutes.
    """

    # -- model and task --
    model: str = "tiny"  # "tiny" (built from tiny_seed into RUN/base_model), a local HF directory or a Hub id
    tiny_seed: int = 0
    task: str = "copy"  # copy | gsm8k | gsm8k_strict | math500 | countdown
    train_data: str | None = None  # local JSONL for training problems (default: the task's train split)
    eval_data: str | None = None  # local JSONL for held-out problems (default: the task's eval_split)
    eval_split: str = "test"
    train_size: int | None = None  # problems in the training pool (None: all / the task default)
    eval_size: int = 128  # held-out problems scored at the center every eval_every iterations
    backend: str = "torch"  # evaluator backend (see espert.evaluators)
    device: str = "cpu"
    dtype: str = "float32"  # float32 | bfloat16 | float16 (live weights; the master is always float32)
    chat_template: bool = False
    max_new_tokens: int = 8
    generation_batch_size: int = 256  # prompts per generate call
    cpu_threads: int = 1  # torch.set_num_threads at start (0: leave torch's default); tiny models run best on 1
    vllm_engines: int = 1  # backend vllm: engines (one per GPU group), each evaluating a share of the members
    vllm_tensor_parallel_size: int = 1
    vllm_gpu_memory_utilization: float | None = None
    vllm_max_model_len: int | None = None
    quant: str = "none"  # backend torch: quantize Linear layers (not lm_head) at load to int8 | fp8 | gptq | awq; ES moves the codes
    quant_group_size: int = 128  # int4 group along K
    include: list[str] | None = None  # parameters ES moves (torch_param_views patterns); None: all
    exclude: list[str] | None = None
    # -- ES --
    iterations: int = 300
    population: int = 32  # N members per iteration (N/2 seeds when antithetic)
    antithetic: bool = True
    sigma: float = 0.02
    sigma_schedule: str = "constant"  # constant | linear | cosine (from sigma to sigma_end)
    sigma_end: float | None = None
    alpha: float = 0.01
    alpha_schedule: str = "constant"
    alpha_end: float | None = None
    normalization: str = "zscore"  # zscore | rank (centered ranks in [-0.5, 0.5])
    weight_decay: float = 0.0  # center *= 1 - α_t·weight_decay before each update
    prompts_per_iteration: int = 32
    seed: int = 0
    member_errors: str = "raise"  # raise | nan (a failing member becomes a dropped nan reward)
    # -- bookkeeping --
    eval_every: int = 25  # held-out evaluation of the center (0: only at start and end)
    checkpoint_every: int = 50  # center.safetensors + export/ (0: only at the end)

    def __post_init__(self):
        self.validate()

    def validate(self) -> "ESConfig":
        """Check types and ranges; raises ValueError naming the offending field."""
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            setattr(self, f.name, _coerce(f.name, getattr(self, f.name), hints[f.name]))

        def need(ok: bool, msg: str):
            if not ok:
                raise ValueError(f"ESConfig: {msg}")

        need(self.population >= 2, f"population must be >= 2, got {self.population}")
        need(not self.antithetic or self.population % 2 == 0,
             f"antithetic sampling needs an even population, got {self.population}")
        need(0 <= self.seed < U64 and 0 <= self.tiny_seed < U64, "seed and tiny_seed must be in [0, 2^64)")
        need(self.iterations >= 0, f"iterations must be >= 0, got {self.iterations}")
        need(self.prompts_per_iteration >= 1, "prompts_per_iteration must be >= 1")
        need(self.eval_size >= 0 and (self.train_size is None or self.train_size >= 1),
             "eval_size must be >= 0 and train_size >= 1")
        need(self.max_new_tokens >= 1 and self.generation_batch_size >= 1,
             "max_new_tokens and generation_batch_size must be >= 1")
        need(self.vllm_engines >= 1 and self.vllm_tensor_parallel_size >= 1,
             "vllm_engines and vllm_tensor_parallel_size must be >= 1")
        need(self.cpu_threads >= 0, f"cpu_threads must be >= 0, got {self.cpu_threads}")
        need(self.eval_every >= 0 and self.checkpoint_every >= 0, "eval_every and checkpoint_every must be >= 0")
        need(self.normalization in NORMALIZATIONS, f"normalization must be one of {NORMALIZATIONS}, "
                                                   f"got {self.normalization!r}")
        need(self.member_errors in ("raise", "nan"), f"member_errors must be 'raise' or 'nan', "
                                                     f"got {self.member_errors!r}")
        need(self.dtype in ("float32", "bfloat16", "float16"), f"unknown dtype {self.dtype!r}")
        from espert.quant.formats import FORMATS

        need(self.quant == "none" or self.quant in FORMATS, f"quant must be 'none' or one of {FORMATS}, "
                                                            f"got {self.quant!r}")
        need(self.quant == "none" or self.backend == "torch",
             f"quant={self.quant!r} quantizes a float model for the torch backend; vLLM loads quantized "
             f"checkpoints (W8A8 int8) itself")
        need(self.quant == "none" or not (self.include or self.exclude),
             "include/exclude select float parameters; with quant, ES moves the quantized Linear codes")
        need(self.quant_group_size == -1 or self.quant_group_size >= 8, "quant_group_size must be -1 or >= 8")
        for name in ("sigma", "alpha"):
            v, kind, end = getattr(self, name), getattr(self, f"{name}_schedule"), getattr(self, f"{name}_end")
            need(math.isfinite(v) and v > 0, f"{name} must be a finite number > 0, got {v}")
            need(kind in SCHEDULES, f"{name}_schedule must be one of {SCHEDULES}, got {kind!r}")
            need(kind == "constant" or end is not None, f"{name}_schedule={kind!r} needs {name}_end")
            need(end is None or (math.isfinite(end) and end >= 0 and (name == "alpha" or end > 0)),
                 f"{name}_end must be finite and {'>= 0' if name == 'alpha' else '> 0'}, got {end}")
        need(math.isfinite(self.weight_decay) and self.weight_decay >= 0, "weight_decay must be >= 0")
        need(self.alpha * self.weight_decay < 1, "alpha·weight_decay must be < 1")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, base: "ESConfig | None" = None) -> "ESConfig":
        """A config from a flat mapping (over ``base``'s values, or the defaults); unknown keys are an error."""
        if not isinstance(d, dict):
            raise ValueError(f"a config must be a mapping of field names to values, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        d = {k.replace("-", "_"): v for k, v in d.items()}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown config key(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        return cls(**{**(base.to_dict() if base else {}), **d})


def _coerce(name: str, v, hint):
    """Check/convert one field value against its annotation (int, float, bool, str, list[str], Optional)."""
    args = typing.get_args(hint)
    if v is None:
        if type(None) in args:
            return None
        raise ValueError(f"ESConfig: {name} must not be empty (null)")
    t = next((a for a in args if a is not type(None)), hint) if args and type(None) in args else hint
    if typing.get_origin(t) is list:
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
            raise ValueError(f"ESConfig: {name} must be a list of strings, got {v!r}")
        return list(v)
    if t is bool:
        if not isinstance(v, bool):
            raise ValueError(f"ESConfig: {name} must be true or false, got {v!r}")
        return v
    if t is int:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"ESConfig: {name} must be an integer, got {v!r}")
        return int(v)
    if t is float:
        if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
            raise ValueError(f"ESConfig: {name} must be a number, got {v!r}")
        return float(v)
    if t is str:
        if not isinstance(v, str):
            raise ValueError(f"ESConfig: {name} must be a string, got {v!r}")
        return v
    raise TypeError(f"ESConfig: unsupported annotation {hint} for {name}")  # pragma: no cover


# ---- derived randomness ------------------------------------------------------------------------

def derive_seed(tag: str, master: int, t: int, j: int) -> int:
    """uint64 from sha256(f"espert/{tag}/{master}/{t}/{j}"): first 8 bytes, little-endian."""
    return int.from_bytes(hashlib.sha256(f"espert/{tag}/{master}/{t}/{j}".encode()).digest()[:8], "little")


def member_seed(master: int, t: int, k: int) -> int:
    """Seed of member (or antithetic pair) k at iteration t."""
    return derive_seed("member", master, t, k)


def population(cfg: ESConfig, t: int) -> list[Member]:
    """The members ``(seed, sign)`` of iteration t: antithetic pairs ``(s_k, +1), (s_k, -1)``, or N seeds with +1."""
    if cfg.antithetic:
        return [(member_seed(cfg.seed, t, k), sign) for k in range(cfg.population // 2) for sign in (1, -1)]
    return [(member_seed(cfg.seed, t, k), 1) for k in range(cfg.population)]


def prompt_indices(cfg: ESConfig, t: int, pool: int) -> list[int]:
    """Indices into the training pool for iteration t (all of it, in order, when it is small enough)."""
    if cfg.prompts_per_iteration >= pool:
        return list(range(pool))
    return random.Random(derive_seed("prompts", cfg.seed, t, 0)).sample(range(pool), cfg.prompts_per_iteration)


def schedule(kind: str, start: float, end: float | None, t: int, total: int) -> float:
    """Value at iteration t in [1, total]: constant, linear or cosine from ``start`` (t=1) to ``end`` (t=total)."""
    if kind == "constant" or end is None:
        return start
    p = (t - 1) / (total - 1) if total > 1 else 0.0
    if kind == "linear":
        return start + (end - start) * p
    if kind == "cosine":
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"unknown schedule {kind!r}; use one of {SCHEDULES}")


# ---- normalization and coefficients -------------------------------------------------------------

def normalize(rewards: Sequence[float], method: str = "zscore") -> np.ndarray:
    """Rewards [N] (nan = failed member) -> normalized scores z [N] float64, 0 for failed members.

    zscore: (r - mean) / std over the valid members (population std); rank: centered ranks
    rank/(n-1) - 0.5 in [-0.5, 0.5], ties sharing their average rank.  All valid rewards equal
    (or fewer than two valid members) → all zeros.
    """
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    valid = np.isfinite(r)
    z = np.zeros_like(r)
    v = r[valid]
    if v.size < 2 or v.max() == v.min():
        return z
    if method == "zscore":
        d = v - v.mean()
        d = d / np.abs(d).max()  # scale first: tiny reward gaps must not underflow the std
        z[valid] = d / d.std()
    elif method == "rank":
        less = (v[None, :] < v[:, None]).sum(1)
        equal = (v[None, :] == v[:, None]).sum(1)
        z[valid] = (less + (equal - 1) / 2.0) / (v.size - 1) - 0.5
    else:
        raise ValueError(f"unknown normalization {method!r}; use one of {NORMALIZATIONS}")
    return z


def coefficients(members: Sequence[Member], rewards: Sequence[float], z: np.ndarray,
                 alpha: float) -> tuple[list[int], list[float]]:
    """Per-seed update coefficients c_k = α/N_valid · Σ sign_n·z_n (valid members only, zeros dropped).

    Seeds appear in first-member order, so the fused update sums members in a fixed order.
    """
    valid = [math.isfinite(r) for r in rewards]
    n_valid = sum(valid)
    acc: dict[int, float] = {}
    for (seed, sign), zi, ok in zip(members, z, valid):
        if ok:
            acc[seed] = acc.get(seed, 0.0) + sign * float(zi)
    pairs = [(s, alpha * v / n_valid) for s, v in acc.items()]
    pairs = [(s, c) for s, c in pairs if c != 0.0]
    return [s for s, _ in pairs], [c for _, c in pairs]


def reward_stats(rewards: Sequence[float]) -> dict:
    """mean/max/min/std over the valid (finite) rewards, and how many were valid."""
    v = np.asarray([r for r in rewards if math.isfinite(r)], dtype=np.float64)
    if v.size == 0:
        return {"mean": None, "max": None, "min": None, "std": None, "n_valid": 0}
    return {"mean": float(v.mean()), "max": float(v.max()), "min": float(v.min()), "std": float(v.std()),
            "n_valid": int(v.size)}


# ---- the step ---------------------------------------------------------------------------------

def es_step(evaluator: Evaluator, cfg: ESConfig, t: int, prompts: Sequence[str], answers: Sequence[str],
            write_ahead: Callable[[dict], None] | None = None) -> dict:
    """One ES iteration t (1-based): evaluate the population, normalize, log, update the center.

    ``write_ahead(record)`` is called after the update is decided and before it is applied (the run
    log); the record holds everything that moves θ: ``seeds``, ``coeffs`` (float64, rounded to
    float32 by the op) and ``decay``.  Returns the record.
    """
    t0 = time.time()
    sigma = schedule(cfg.sigma_schedule, cfg.sigma, cfg.sigma_end, t, cfg.iterations)
    alpha = schedule(cfg.alpha_schedule, cfg.alpha, cfg.alpha_end, t, cfg.iterations)
    members = population(cfg, t)
    rewards = [float(r) for r in evaluator.evaluate(members, sigma, prompts, answers)]
    if len(rewards) != len(members):
        raise RuntimeError(f"evaluator returned {len(rewards)} rewards for {len(members)} members")
    z = normalize(rewards, cfg.normalization)
    seeds, coeffs = coefficients(members, rewards, z, alpha)
    stats = reward_stats(rewards)
    skipped = stats["n_valid"] == 0
    decay = 1.0 if skipped else 1.0 - alpha * cfg.weight_decay
    record = {"kind": "iter", "iteration": t, "sigma": sigma, "alpha": alpha, "members": [list(m) for m in members],
              "rewards": [r if math.isfinite(r) else None for r in rewards], "reward": stats,
              "seeds": seeds, "coeffs": coeffs, "decay": decay, "skipped": skipped,
              "eval_seconds": round(time.time() - t0, 4)}
    if write_ahead is not None:
        write_ahead(record)
    apply_record(evaluator, record)
    return record


def apply_record(evaluator: Evaluator, record: dict) -> None:
    """Apply a logged update (training and replay share this): decay, then Σ coeffs·ε(seeds)."""
    if record["seeds"] or record["decay"] != 1.0:
        evaluator.update(record["seeds"], record["coeffs"], record["decay"])


# ---- a run --------------------------------------------------------------------------------------

def train(cfg: ESConfig | None, run_dir: str, resume: bool = False, progress: bool = True,
          hook: Callable[[int, str], None] | None = None, echo: Callable[[str], None] | None = print) -> dict:
    """Train (or resume) a run in ``run_dir``; returns a summary dict
    ``{"run_dir", "iterations", "heldout": [(t, mean)], "train_reward": [(t, mean)], "export"}``.

    cfg: the run's config; with ``resume`` it may be None (use the stored one) or must match the
    stored one except for ``runs.RESUMABLE_CHANGES``.  echo: where status lines go (None: nowhere).

    hook(t, phase) is called at phases ``"logged"`` (record appended, update not yet applied),
    ``"updated"`` and ``"checkpointed"`` of each iteration; tests use it to crash a run anywhere.
    """
    from espert import runs

    import torch

    run = runs.Run.open(run_dir, cfg, resume=resume, echo=echo)
    cfg = run.cfg
    threads = torch.get_num_threads()
    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    evaluator = None
    try:
        train_task, eval_task = runs.load_tasks(cfg)
        evaluator = runs.build_run_evaluator(run, train_task)
        start = run.restore(evaluator)
        T = cfg.iterations
        if start > T:
            raise ValueError(f"{run_dir} already logged {start} iterations, more than iterations={T}")
        last_eval = run.last_eval()
        if start == 0 and last_eval is None and eval_task is not None:
            last_eval = run.evaluate_heldout(evaluator, eval_task, 0)
        bar = _progress(progress, T, start)
        for t in range(start + 1, T + 1):
            idx = prompt_indices(cfg, t, len(train_task))

            def write_ahead(rec: dict) -> None:
                rec["prompt_indices"] = idx
                rec["time"] = time.time()
                run.append(rec)
                if hook:
                    hook(rec["iteration"], "logged")

            rec = es_step(evaluator, cfg, t, [train_task.prompts[i] for i in idx],
                          [train_task.answers[i] for i in idx], write_ahead)
            if hook:
                hook(t, "updated")
            if rec["skipped"] and echo:
                echo(f"[espert] iteration {t}: every member failed; update skipped")
            if eval_task is not None and t < T and cfg.eval_every and t % cfg.eval_every == 0:
                last_eval = run.evaluate_heldout(evaluator, eval_task, t)
            if t < T and cfg.checkpoint_every and t % cfg.checkpoint_every == 0:
                run.checkpoint(evaluator, t)
                if hook:
                    hook(t, "checkpointed")
            if t == T and eval_task is not None:
                last_eval = run.evaluate_heldout(evaluator, eval_task, t)
            if bar is not None:
                post = {"r_mean": rec["reward"]["mean"], "r_max": rec["reward"]["max"]}
                if last_eval is not None:
                    post["heldout"] = last_eval["mean"]
                bar.set_postfix({k: ("nan" if v is None else f"{v:.3f}") for k, v in post.items()}, refresh=False)
                bar.update(1)
        if bar is not None:
            bar.close()
        # the end state: final held-out score and checkpoint (also when a crash hit right after the last update)
        if eval_task is not None and (last_eval is None or last_eval["iteration"] != T):
            run.evaluate_heldout(evaluator, eval_task, T)
        if run.checkpoint_iteration() != T:
            run.checkpoint(evaluator, T)
            if hook:
                hook(T, "checkpointed")
        return run.summary()
    finally:
        if evaluator is not None:
            evaluator.close()
        run.close()
        torch.set_num_threads(threads)


def _progress(enabled: bool, total: int, initial: int):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="espert train", unit="it", dynamic_ncols=True)


__all__ = ["ESConfig", "es_step", "apply_record", "train", "normalize", "coefficients", "population",
           "prompt_indices", "member_seed", "derive_seed", "schedule", "reward_stats"]
