"""The torch / transformers evaluator: greedy ``generate`` on CPU or GPU, batched, left-padded."""

from __future__ import annotations

import logging
import math
from typing import Callable, Sequence

import torch

from espert.center import Center, CenterStore
from espert.params import lora_carried, torch_param_views
from espert.tasks.base import chat_prompt

from .base import ModelEvaluator, score_and_extract

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """``"float32" | "bfloat16" | "float16"`` -> the torch dtype (clear error otherwise)."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}")
    return DTYPES[name]


def load_model(path: str, device: str = "cpu", dtype: str = "float32"):
    """Load ``(model, tokenizer)`` from a local model directory or Hub id, in eval mode on ``device``.

    The tokenizer is set to left padding; a missing pad token falls back to the eos token.  A quantized checkpoint
    in a scheme espert edits keeps its codes in QuantLinear layers: compressed-tensors (llm-compressor's W8A8 /
    W4A16) as transformers loaded them, before it would decompress them
    (:func:`espert.quant.checkpoint.adopt_compressed`); GPTQ and AWQ as stored
    (:func:`espert.quant.checkpoint.load_packed_model`).
    """
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer

    if os.path.sep in path and not os.path.isdir(path):
        raise FileNotFoundError(f"model directory not found: {path}")
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"tokenizer of {path} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    from espert.quant.checkpoint import (
        UnsupportedScheme,
        adopt_compressed,
        load_packed_model,
        quantization_config,
        weight_scheme,
    )

    try:
        scheme = weight_scheme(quantization_config(path))
    except UnsupportedScheme:  # another scheme: transformers runs it its own way (training refuses it earlier)
        scheme = None
    if scheme is not None and scheme["format"] in ("gptq", "awq"):
        model = load_packed_model(path, torch_dtype(dtype), scheme)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype))
        if scheme is not None:
            adopt_compressed(model)
    model = model.to(device).eval()
    model.requires_grad_(False)
    return model, tok


def model_center(
    model: torch.nn.Module,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    pin: bool = False,
    **center_kw,
) -> CenterStore:
    """The float32 host center of a torch model's selected parameters (see ``torch_param_views``).

    center_kw: passed to :class:`~espert.center.CenterStore` (noise, optimizer, sigma_scales, no_decay).
    """
    return CenterStore(
        torch_param_views(model, include=include, exclude=exclude), master_dtype=torch.float32, pin=pin, **center_kw
    )


def rms_scales(views) -> list[float]:
    """Per-view σ multipliers for ``sigma_mode: rms``: the RMS of each tensor (float64; 1.0 for an all-zero one).

    Computed from the weights as loaded (the base model), never from a trained center, so a
    resumed run and a replay get the same scales.
    """
    return [tensor_rms(v.tensor) for v in views]


def tensor_rms(t: torch.Tensor) -> float:
    """The ``sigma_mode: rms`` multiplier of one whole (logical) tensor of any float dtype: its RMS, computed
    in float64 (1.0 for an all-zero or empty tensor).  The one formula: the vLLM evaluator applies it to
    the checkpoint's logical tensors, so sharded and fused weights get the scale of the whole tensor."""
    n = t.numel()
    rms = float(torch.linalg.vector_norm(t, dtype=torch.float64)) / n**0.5 if n else 0.0
    return rms if rms > 0 else 1.0


def optimizer_spec(cfg) -> dict:
    """The optimizer of a run config as the plain dict :class:`~espert.center.Optimizer` takes (picklable:
    the vLLM evaluator sends it to its workers)."""
    return {
        "name": cfg.optimizer,
        "beta1": cfg.optimizer_beta1,
        "beta2": cfg.optimizer_beta2,
        "eps": cfg.optimizer_eps,
    }


def config_center(model: torch.nn.Module, cfg, pin: bool = False):
    """The center a run's config asks for: float (include/exclude, noise, optimizer, σ mode, decay
    exclusions) or, with ``cfg.quant``, the quantized codes (quantizing ``model`` in place).  Training
    and replay both build it here, so they move the same tensors the same way.  A model loaded from a quantized
    checkpoint (QuantLinear layers already) trains its codes and exports them in the checkpoint's format."""
    from espert.quant import QuantLinear

    if any(isinstance(m, QuantLinear) for m in model.modules()):
        if cfg.quant != "none":
            raise ValueError(f"quant={cfg.quant!r}: the checkpoint is quantized already; leave --quant out")
        return checkpoint_quant_center(model, cfg, pin)
    if cfg.quant != "none":
        from espert.quant import model_quant_center, quantize_model

        if (cfg.optimizer, cfg.sigma_mode) != ("sgd", "absolute"):
            raise ValueError(
                f"quant={cfg.quant!r} supports optimizer=sgd and sigma_mode=absolute "
                f"(got {cfg.optimizer}, {cfg.sigma_mode})"
            )
        quantized = quantize_model(model, cfg.quant, group_size=cfg.quant_group_size)
        return model_quant_center(
            quantized, master=cfg.quant_master, pin=pin, noise=cfg.noise, anchor=cfg.anchor_decay > 0
        )
    views = torch_param_views(model, include=cfg.include, exclude=cfg.exclude)
    if cfg.vllm_members == "batched":  # vLLM's LoRA members move only these
        views = lora_carried(model, views)
    return CenterStore(
        views,
        master_dtype=torch.float32,
        pin=pin,
        noise=cfg.noise,
        optimizer=optimizer_spec(cfg),
        sigma_scales=rms_scales(views) if cfg.sigma_mode == "rms" else None,
        no_decay=cfg.weight_decay_exclude,
        restore=cfg.restore,
        anchor=cfg.anchor_decay > 0,
    )


def checkpoint_quant_center(model: torch.nn.Module, cfg, pin: bool = False):
    """The center of a model loaded from a quantized checkpoint, as the vLLM evaluator builds it: the float tensors
    (embeddings, norms, lm_head) and the codes, both selected by ``cfg.include`` / ``cfg.exclude``; the codes are
    exported as codes, in the checkpoint's format.  Plain sgd with absolute σ (the noise is in code units)."""
    from espert.params import matches
    from espert.quant import quant_param_views
    from espert.quant.center import QuantModelCenter, model_center_stores

    if (cfg.optimizer, cfg.sigma_mode) != ("sgd", "absolute"):
        raise ValueError(
            f"a quantized checkpoint trains with optimizer=sgd and sigma_mode=absolute "
            f"(got {cfg.optimizer}, {cfg.sigma_mode})"
        )
    inc, exc, anchor = cfg.include, cfg.exclude, cfg.anchor_decay > 0
    qviews = [
        v for v in quant_param_views(model) if (not inc or matches(v.name, inc)) and not (exc and matches(v.name, exc))
    ]
    stores = model_center_stores(
        lambda: torch_param_views(model, include=inc, exclude=exc),
        qviews,
        master=cfg.quant_master,
        selection=f"include={inc}, exclude={exc}",
        pin=pin,
        noise=cfg.noise,
        anchor=anchor,
        export="codes",
    )
    return QuantModelCenter(*stores)


def build(cfg, model_path: str, score: Callable, extract: Callable | None = None) -> "TorchEvaluator":
    """The ``"torch"`` evaluator of a run config (registered in :mod:`espert.evaluators`); extract: the
    task's answer extractor (then ``member_answers`` is filled)."""
    model, tok = load_model(model_path, device=cfg.device, dtype=cfg.dtype)
    center = config_center(model, cfg, pin=next(model.parameters()).device.type == "cuda")
    return TorchEvaluator(
        model,
        tok,
        score,
        max_new_tokens=cfg.max_new_tokens,
        batch_size=cfg.generation_batch_size,
        chat_template=cfg.chat_template,
        member_errors=cfg.member_errors,
        center=center,
        extract=extract,
    )


class TorchEvaluator(ModelEvaluator):
    """Rewards of a transformers causal LM under greedy decoding.

    model: a ``*ForCausalLM`` in eval mode (any device/dtype the ops support).  tokenizer: its
    tokenizer (left padding is forced).  score: batched reward ``fn(completions, answers) ->
    list[float]`` (a :class:`espert.tasks.Task`'s ``score``).  include / exclude: which parameters
    ES perturbs (``torch_param_views`` patterns).  max_new_tokens: generation budget per prompt.
    batch_size: prompts per ``generate`` call.  chat_template: wrap prompts as a user message.
    center: the :class:`~espert.center.Center` of the model's weights (default: the float32
    :func:`model_center` of the selected parameters; include / exclude are then ignored).
    extract: the task's answer extractor ``fn(completion, answer) -> str | None``; when given,
    :meth:`evaluate` also records each member's extracted answers in ``member_answers``.

    A member's rollout: the tokenized prompts (cached) go through plain greedy ``generate`` (the
    model's stop tokens, nothing else from its generation config) in
    chunks of ``batch_size``; new tokens are decoded with special tokens skipped and scored.
    Greedy decoding is deterministic on a fixed device/dtype/batch, so rewards are a function of
    (center, member, prompts).
    """

    def __init__(
        self,
        model,
        tokenizer,
        score: Callable[[Sequence[str], Sequence[str]], list[float]],
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        max_new_tokens: int = 16,
        batch_size: int = 64,
        chat_template: bool = False,
        member_errors: str = "raise",
        center: Center | None = None,
        extract: Callable | None = None,
    ):
        if max_new_tokens < 1 or batch_size < 1:
            raise ValueError(f"max_new_tokens and batch_size must be >= 1, got {max_new_tokens}, {batch_size}")
        device = next(model.parameters()).device
        if center is None:
            center = model_center(model, include, exclude, pin=device.type == "cuda")
        super().__init__(center, member_errors)
        self.model, self.tokenizer, self.score, self.extract = model, tokenizer, score, extract
        self.tokenizer.padding_side = "left"
        self.device = device
        self.batch_size = batch_size
        self.chat_template = chat_template
        # plain greedy decoding: only the model's stop tokens are kept from its generation config
        # (no sampling settings, no repetition penalty), as with temperature-0 vLLM sampling
        from transformers import GenerationConfig

        eos = getattr(model.generation_config, "eos_token_id", None)
        gc = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            eos_token_id=eos if eos is not None else tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=getattr(model.generation_config, "bos_token_id", None),
        )
        # transformers fills unset fields of a passed config from model.generation_config (e.g. a
        # repetition penalty): the evaluator owns the model, so it replaces that config as well
        model.generation_config = gc
        self.generation_config = gc
        self._cache_key: tuple | None = None
        self.tokens_processed = 0
        self._batches: list[dict[str, torch.Tensor]] = []

    def _format(self, prompt: str) -> str:
        if not self.chat_template:
            return prompt
        return chat_prompt(self.tokenizer, prompt)

    def _encoded(self, prompts: Sequence[str]) -> list[dict[str, torch.Tensor]]:
        key = tuple(prompts)
        if key != self._cache_key:  # the same prompts serve every member of an iteration
            self._batches = []
            for i in range(0, len(prompts), self.batch_size):
                chunk = [self._format(p) for p in prompts[i : i + self.batch_size]]
                enc = self.tokenizer(chunk, return_tensors="pt", padding=True)
                self._batches.append({k: v.to(self.device) for k, v in enc.items()})
            self._cache_key = key
        return self._batches

    @torch.inference_mode()
    def generate(self, prompts: Sequence[str], entropy: list | None = None) -> list[str]:
        """Greedy completions (new text only) of the live weights for ``prompts``.

        entropy: a list that gets ``(sum of H, tokens)`` per batch, H the entropy in bits of the
        policy's next-token distribution (softmax of the logits, float64) at every generated token
        before the sequence ends; the completions are the same with or without it.
        """
        out: list[str] = []
        for enc in self._encoded(prompts):
            if entropy is None:
                seqs = self.model.generate(**enc, generation_config=self.generation_config)
            else:
                res = self.model.generate(
                    **enc, generation_config=self.generation_config, output_logits=True, return_dict_in_generate=True
                )
                seqs = res.sequences
            new = seqs[:, enc["input_ids"].shape[1] :]
            if entropy is not None:
                logp = torch.stack(res.logits, 1).double().log_softmax(-1)  # [B, steps, V]
                h = -(logp.exp() * logp).sum(-1) / math.log(2)
                eos = self.generation_config.eos_token_id
                ended = torch.isin(new, torch.tensor(eos if isinstance(eos, list) else [eos], device=new.device))
                # a step counts until the one that produced the end token, that one included
                counted = (ended.cumsum(1) - ended.long()) == 0
                entropy.append((float(h[counted].sum()), int(counted.sum())))
            # forward-FLOP accounting (espert.diagnostics): prompt tokens + generated tokens before padding
            self.tokens_processed += int(enc["attention_mask"].sum()) + int((new != self.tokenizer.pad_token_id).sum())
            out.extend(self.tokenizer.batch_decode(new, skip_special_tokens=True))
        return out

    def evaluate_center(self, prompts, answers):
        parts: list = []
        rewards = list(self.score(self.generate(prompts, entropy=parts), answers))
        tokens = sum(n for _, n in parts)
        self.last_token_entropy = sum(h for h, _ in parts) / tokens if tokens else None
        return rewards

    def rollout(self, prompts, answers):
        return list(self.score(self.generate(prompts), answers))

    def rollout_answers(self, prompts, answers):
        """``(rewards, extracted answers)`` of the live weights' completions (needs ``extract``)."""
        return score_and_extract(self.score, self.extract, self.generate(prompts), answers)

    def close(self) -> None:
        self.model = None
        self._batches = []
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def quiet_transformers() -> None:
    """Silence transformers' load/save progress bars and per-call notices (the CLI calls this)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("transformers.generation.utils").setLevel(logging.ERROR)
