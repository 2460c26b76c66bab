"""A tiny causal LM and a character-level tokenizer, built locally (no downloads).

The main job (``espert train`` with no arguments) first pretrains this model on a built-in
corpus (:func:`pretrain`: next-character prediction, 600 steps, about half a minute on one core),
then post-trains it with ES on the built-in ``copy`` task.  The corpus mixes two behaviours in the
copy task's prompt format: half the lines are copies (``"cafe>cafe"``), half reversals
(``"cafe>efac"``).  The pretrained model does each of them reliably and picks one per prompt
(greedy on 128 held-out prompts: 48% exact copies, 39% exact reversals, copy reward 0.60), so ES
has to shift a preference between two behaviours the base already has, not invent one: the
situation of the seed papers, where post-training elicits a behaviour of the base.

The directory written by :func:`build_tiny_model` is a standard Hugging Face model directory::

    config.json  generation_config.json  model.safetensors
    tokenizer.json  tokenizer_config.json  special_tokens_map.json (depending on the transformers version)

so it loads with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``
and with vLLM (Llama architecture, head_dim 32, which vLLM's CPU attention supports).

Everything is a deterministic function of the arguments: the same ``seed`` gives the same
weights bit for bit (torch's CPU generator; pretraining on one thread, for a fixed torch build),
and the tokenizer does not depend on any data.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

#: Special tokens, in id order: 0 <pad>, 1 <s>, 2 </s>, 3 <unk>.
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
#: Default alphabet: the ``copy`` task's letters and its separator.
DEFAULT_ALPHABET = "abcdef>"


@dataclass(frozen=True)
class TinySpec:
    """Shape of the tiny model.  Defaults: 2 layers, hidden 64, 2 heads of dim 32 (~83k parameters).

    init_std: std of the normal initialization of linear/embedding weights (transformers'
    ``initializer_range``).  A larger value than the usual 0.02 gives a random model whose
    greedy outputs already depend on the input, which ES can then shape.
    """

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 64
    init_std: float = 0.02
    alphabet: str = DEFAULT_ALPHABET


def tiny_spec(hidden_size: int = 64) -> TinySpec:
    """The tiny model at another width: MLP 2x the hidden size, heads of dim 32 (64: the default)."""
    if hidden_size < 32 or hidden_size % 32:
        raise ValueError(f"tiny hidden size must be a positive multiple of 32, got {hidden_size}")
    return TinySpec(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_attention_heads=hidden_size // 32)


def build_tokenizer(alphabet: str = DEFAULT_ALPHABET):
    """A character-level tokenizer over ``alphabet`` (one token per character), as ``PreTrainedTokenizerFast``.

    Trained with ``tokenizers``' BPE trainer with a vocabulary exactly the size of the specials plus
    the alphabet, so no merges are learnt: ids 0-3 are ``<pad> <s> </s> <unk>``, then the characters
    in sorted order (the trainer sorts its alphabet).  Encoding prepends ``<s>``; decoding concatenates characters (no spaces).
    Characters outside the alphabet encode as ``<unk>``.
    """
    from tokenizers import Tokenizer, decoders, models, processors, trainers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(alphabet))  # unique, order kept
    if not chars:
        raise ValueError("the tiny tokenizer needs a non-empty alphabet")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer = trainers.BpeTrainer(
        vocab_size=len(SPECIAL_TOKENS) + len(chars),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=chars,
        limit_alphabet=len(chars),
        show_progress=False,
    )
    tok.train_from_iterator([alphabet], trainer=trainer)
    vocab = tok.get_vocab()
    missing = [c for c in chars if c not in vocab]
    if missing or len(vocab) != len(SPECIAL_TOKENS) + len(chars):
        raise RuntimeError(f"tiny tokenizer: unexpected vocabulary {sorted(vocab, key=vocab.get)}")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def pretrain_corpus(n: int, seed: int = 0, reverse_share: float = 0.0) -> list[str]:
    """``n`` lines ``"{s}>{t}"`` over unique strings ``s`` of the copy task's *train* pool (never a
    held-out string): ``t = s`` (copy) or, on a ``reverse_share`` of the lines, ``t = s[::-1]``.

    Both behaviours share the copy task's prompt format, so a model pretrained on the mixture picks
    one of them per prompt.  Deterministic in ``(n, seed, reverse_share)``.
    """
    import random

    from espert.tasks.copy_task import COPY_SEP, generate_copy_strings

    if not 0.0 <= reverse_share <= 1.0:
        raise ValueError(f"reverse_share must be in [0, 1], got {reverse_share}")
    rng = random.Random(f"espert-tiny-corpus-{seed}")
    strings = generate_copy_strings(n, seed, heldout=False)
    return [s + COPY_SEP + (s[::-1] if rng.random() < reverse_share else s) for s in strings]


#: Pretraining learning rate.  1e-2 plateaus (greedy held-out copy reward ~0.7 after 300 steps,
#: no better after 1000); 3e-3 copies every held-out string after 600 steps on copy lines alone.
PRETRAIN_LR = 3e-3


def pretrain(
    model,
    tokenizer,
    steps: int,
    seed: int = 0,
    batch_size: int = 64,
    lr: float = PRETRAIN_LR,
    reverse_share: float = 0.0,
) -> list[float]:
    """Next-character training of ``model`` in place on :func:`pretrain_corpus` (AdamW, cosine decay).

    Each line is ``<s> text </s>``; the loss is the mean cross-entropy over all characters and the
    end token.  Runs on one CPU thread (restored afterwards), so the result is deterministic in the
    arguments for a fixed torch build, whatever the machine's core count.  Returns the loss of
    every step.
    """
    import torch

    from espert.progress import bar

    if steps <= 0:
        return []
    lines = pretrain_corpus(min(4096, steps * batch_size), seed, reverse_share)
    enc = [tokenizer(t).input_ids + [tokenizer.eos_token_id] for t in lines]
    L = max(len(e) for e in enc)
    ids = torch.full((len(enc), L), tokenizer.pad_token_id, dtype=torch.long)
    for i, e in enumerate(enc):
        ids[i, : len(e)] = torch.tensor(e)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # reductions in the backward pass depend on the thread count
    model.train()
    model.requires_grad_(True)
    losses = []
    try:
        with bar("[espert] pretraining the tiny model", steps) as shown:
            for _ in range(steps):
                batch = ids[torch.randint(0, len(ids), (batch_size,), generator=gen)]
                mask = batch != tokenizer.pad_token_id
                labels = batch.masked_fill(~mask, -100)
                loss = model(input_ids=batch, attention_mask=mask.long(), labels=labels).loss
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                losses.append(float(loss.detach()))
                shown.update(1)
    finally:
        torch.set_num_threads(threads)
        model.eval()
        model.requires_grad_(False)
    return losses


def _llama_config(spec: TinySpec, tok):
    """The transformers LlamaConfig of the tiny model: ``spec``'s shapes over ``tok``'s vocabulary, untied."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_attention_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.init_std,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )


def build_tiny_model(
    save_dir: str,
    seed: int = 0,
    spec: TinySpec | None = None,
    pretrain_steps: int = 0,
    reverse_share: float = 0.0,
    pretrain_lr: float = PRETRAIN_LR,
):
    """Write a Llama-architecture tiny model + tokenizer to ``save_dir``; returns the model (float32, CPU).

    ``pretrain_steps`` = 0: random initialization.  Otherwise the model is then pretrained for that
    many steps with :func:`pretrain` (seeded with ``seed``, learning rate ``pretrain_lr``) on
    copy lines, ``reverse_share`` of them reversed.  Deterministic in the arguments (pretraining:
    for a fixed torch build).  ``save_dir`` is created; existing files in it are overwritten.  Also
    writes ``espert_tiny.json`` recording the seed, spec and pretraining (steps, corpus, lr, final loss).
    """
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    spec = spec or TinySpec()
    os.makedirs(save_dir, exist_ok=True)
    tok = build_tokenizer(spec.alphabet)
    config = _llama_config(spec, tok)
    # Weights come from torch's CPU generator, seeded here, in module construction order.
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32).eval()
    finally:
        torch.random.set_rng_state(state)
    losses = pretrain(model, tok, pretrain_steps, seed=seed, reverse_share=reverse_share, lr=pretrain_lr)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=False
    )
    model.save_pretrained(save_dir, safe_serialization=True)
    tok.save_pretrained(save_dir)
    pre = {"steps": pretrain_steps, "corpus": "copy lines over the copy train pool"}
    pre["final_loss"] = losses[-1] if losses else None
    if pretrain_steps > 0:  # random-init bases keep the file of older versions (it is in run fingerprints)
        pre.update(
            corpus="copy and reversed lines over the copy train pool", reverse_share=reverse_share, lr=pretrain_lr
        )
    with open(os.path.join(save_dir, "espert_tiny.json"), "w", encoding="utf-8") as f:
        json.dump({"seed": seed, "spec": asdict(spec), "pretrain": pre}, f, indent=2)
        f.write("\n")
    return model
