"""espert's models in lm-evaluation-harness: ``import espert.eval.lmeval`` registers the model ``"espert"``.

    import espert.eval.lmeval  # noqa: F401  (registers "espert" with lm-eval)
    import lm_eval
    lm_eval.simple_evaluate(model="espert", model_args="pretrained=runs/es-smollm2", tasks=["hellaswag"])

``pretrained``: anything espert's commands take (a model directory, a GGUF file, ``smollm2-135m-instruct``, an
ES run directory), or a RandOpt run directory with ``member=R``, that ensemble member rebuilt by the ops.
Log-likelihoods come from :func:`espert.eval.mc.loglikelihoods`; generation is greedy.  lm-eval 0.4 reads no
entry points, so the import is the registration (docs/eval.md).  Needs ``pip install lm-eval`` (0.4.13 tested).
"""

from __future__ import annotations

import os

from espert.extras import require

require("lm_eval", "espert's lm-eval model (espert.eval.lmeval)")
from lm_eval.api.model import LM  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402


def load_member(run_dir: str, rank: int):
    """(model, tokenizer) of member ``rank`` (from 1) of a RandOpt run's ensemble, built with the ops."""
    from espert.config import ESConfig
    from espert.evaluators import config_center, load_model

    from .samplers import read_ensemble

    doc, base = read_ensemble(run_dir)
    if not 1 <= rank <= len(doc["members"]):
        raise ValueError(f"member must be a rank in the ensemble (1..{len(doc['members'])}), got {rank}")
    cfg = ESConfig.from_dict(doc["config"])
    model, tok = load_model(base, dtype=cfg.dtype)
    m = doc["members"][rank - 1]
    config_center(model, cfg).perturb(int(m["seed"]), float(m["sigma"]), 1)  # the live weights stay perturbed
    return model, tok


@register_model("espert")
class EspertLM(LM):
    """An espert model or run as an lm-eval ``LM`` (module docstring).  CPU or CUDA (``device``), float32 by
    default (``dtype``), ``batch_size`` sequences per forward."""

    def __init__(self, pretrained: str, member: int | None = None, device: str = "cpu", dtype: str = "float32",
                 batch_size: int | str = 16, max_gen_toks: int = 256, **_):  # fmt: skip
        super().__init__()
        from espert.evaluators import load_model

        from .forgetting import resolve_models

        if member is not None:
            self.model, self.tok = load_member(pretrained, int(member))
        else:
            self.model, self.tok = load_model(resolve_models([f"m={pretrained}"])["m"], dtype=dtype)
        self.model.to(device)
        self.tok.padding_side = "right"
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 16
        self.max_gen_toks = int(max_gen_toks)

    @property
    def tokenizer_name(self) -> str:
        return os.path.basename(str(getattr(self.tok, "name_or_path", "espert"))).replace("/", "__")

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        return self.tok.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=add_generation_prompt)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        from .mc import loglikelihoods

        return loglikelihoods(self.model, self.tok, [r.args[:2] for r in requests], self.batch_size)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Σ log p of every token of the string (:func:`espert.eval.mc.encode`, BOS included where the
        tokenizer adds it), in lm-eval's windows of the model's context length, the first conditioned on the
        prefix token."""
        from .mc import rolling_windows, token_loglikelihoods

        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        out = []
        for r in requests:
            windows = rolling_windows(self.tok, r.args[0], self.max_length)
            out.append(sum(ll for ll, _ in token_loglikelihoods(self.model, windows, pad, self.batch_size)))
        return out

    @property
    def max_length(self) -> int:
        """The model's context length, as lm-eval's HF backend reads it (its config, else 2048)."""
        cfg = getattr(self.model, "config", None)
        for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
            if getattr(cfg, attr, None):
                return int(getattr(cfg, attr))
        return 2048

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy completions of the context as :func:`espert.eval.mc.encode` tokenizes it, cut at the first
        of the request's ``until`` strings and the end-of-text token's (lm-eval's HF backend)."""
        import torch

        from .mc import encode

        eos = self.tok.decode(self.tok.eos_token_id, skip_special_tokens=False)
        out = []
        for r in requests:
            context, kw = r.args[0], dict(r.args[1]) if len(r.args) > 1 else {}
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            until += [eos] if eos not in until else []
            ids = torch.tensor([encode(self.tok, context)], device=self.model.device)
            with torch.inference_mode():
                seq = self.model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                    max_new_tokens=int(kw.get("max_gen_toks", self.max_gen_toks)), pad_token_id=self.tok.pad_token_id,
                )  # fmt: skip
            text = self.tok.decode(seq[0, ids.shape[1] :], skip_special_tokens=True)
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            out.append(text)
        return out
