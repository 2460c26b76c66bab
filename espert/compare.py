"""ES against GRPO on one machine: the seed papers' comparison in miniature.

    espert compare --out runs/compare           # full run (8 minutes on a loaded 2-core machine)
    espert compare --out runs/compare --fast    # the CI variant (about a minute)

(``python -m espert.compare`` is the same command.)

One base model (by default the tiny model pretrained locally, :func:`espert.tiny.build_tiny_model`;
``--model`` takes any model ``espert train`` takes, e.g. ``smollm2-135m-instruct``), one task (by
default the built-in ``copy``; ``--task`` and ``--train-data``/``--eval-data`` as in train), one
reward, one training prompt pool, one rollout budget:

1. **ES**: espert's :func:`espert.es.es_step` on the torch or vLLM evaluator (greedy rollouts of
   perturbed members), ``iterations × population × prompts_per_iteration`` rollouts.
2. **GRPO**: ``trl.GRPOTrainer`` (sampled rollouts, ``num_generations`` per prompt, no KL term),
   as many optimizer steps as give the same number of rollouts.
3. **Evaluation**: base, ES and GRPO with ``espert eval`` (``n`` samples per held-out problem,
   temperature sampling): pass@k and maj@k curves, the 12-bin coverage histograms, progressions
   and regressions against the base, answer entropy.
4. **Drift**: ``espert analyze`` drift of both fine-tuned models against the base.
5. **Token entropy** of every model on the probe set (the held-out prompts), and of ES's center and
   GRPO's policy at ``probe_points + 1`` equally spaced points of their training (:class:`Probe`).

Both budgets are counted the same way: one rollout is one completion of one prompt; generated
tokens are the completion's token ids up to and including the end token; forward FLOPs are
``2·P·(prompt + generated tokens)`` for the rollouts (GRPO's backward pass, about twice the forward,
is reported separately).  Everything lands in ``OUT/report.md``, ``OUT/compare.json`` and the PNGs.

TRL is an optional extra (``pip install espert[compare]``); without it :func:`run_compare` stops with
:class:`espert.extras.MissingExtra` before it builds anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from espert.extras import require
from espert.tasks.base import chat_prompt


#: What the two methods are compared on (model, task, budget).  Defaults: the full run.
@dataclass
class CompareConfig:
    """What is compared and at which size.  ``fast()`` gives the CI variant.  Every field is also an
    ``espert compare`` flag (``--prompts-per-iteration 16``)."""

    # model 'tiny' (built from tiny_seed) or what `espert train --model` takes: a directory, a Hub id,
    # a GGUF file or a named GGUF such as smollm2-135m-instruct
    model: str = "tiny"
    task: str = "copy"  # a built-in task or an import path, as `espert train --task`
    train_data: Optional[str] = None  # local JSONL of training problems (default: the task's train split)
    eval_data: Optional[str] = None  # local JSONL of held-out problems (default: the task's test split)
    chat_template: bool = False  # wrap prompts in the tokenizer's chat template (ES, GRPO and eval alike)
    evaluator: str = "torch"  # ES rollouts and held-out sampling: torch or vllm (GRPO: TRL's generate)
    probe_points: int = 5  # token entropy during training at probe_points + 1 equally spaced points
    tiny_seed: int = 0
    pretrain_steps: int = 300
    # 1e-2 plateaus at a base that copies only part of the time (greedy reward ~0.7): the partly
    # capable base this comparison was run on (docs/eval.md §7); the main job pretrains at 3e-3.
    pretrain_lr: float = 1e-2
    train_size: int = 512  # training prompt pool (copy train split)
    eval_size: int = 64  # held-out problems (copy test split) for espert eval
    n: int = 32  # samples per held-out problem
    temperature: float = 1.0
    max_new_tokens: int = 8
    # ES
    iterations: int = 60
    population: int = 32
    prompts_per_iteration: int = 16
    sigma: float = 0.02
    alpha: float = 0.02
    # GRPO
    num_generations: int = 8
    prompts_per_step: int = 8
    learning_rate: float = 1e-3
    seed: int = 0
    # sequential compositions, e.g. ("es:0.5,grpo:0.5",): phases trained one after the other
    schedules: tuple = ()

    @classmethod
    def fast(cls) -> "CompareConfig":
        return cls(
            pretrain_steps=150, train_size=128, eval_size=16, n=8, iterations=6, population=8, prompts_per_iteration=8
        )

    def es_rollouts(self) -> int:
        return self.iterations * self.population * self.prompts_per_iteration

    def grpo_steps(self) -> int:
        """Optimizer steps giving GRPO the same number of rollouts as ES (rounded up)."""
        per_step = self.num_generations * self.prompts_per_step
        return -(-self.es_rollouts() // per_step)


#: the methods a schedule's phases may name
METHODS = ("es", "grpo")


def parse_schedule(spec: str) -> list[tuple[str, float]]:
    """``"es,grpo"`` or ``"es:0.25,grpo:0.75"`` -> [(method, share of the rollout budget)].

    Phases without a share split what the others leave equally; the shares must sum to at most 1,
    so a composition never gets more rollouts than ES or GRPO alone.
    """
    phases, given = [], 0.0
    for part in spec.split(","):
        method, _, share = part.strip().partition(":")
        if method not in METHODS:
            raise ValueError(f"schedule {spec!r}: unknown phase {method!r}; phases are {', '.join(METHODS)}")
        try:
            value = float(share) if share else None
        except ValueError:
            raise ValueError(f"schedule {spec!r}: share {share!r} is not a number") from None
        if value is not None and not 0 < value <= 1:
            raise ValueError(f"schedule {spec!r}: a phase's share must be in (0, 1], got {value}")
        given += value or 0.0
        phases.append((method, value))
    if len(phases) < 2:
        raise ValueError(f"schedule {spec!r}: a composition needs two or more phases (ES and GRPO alone always run)")
    if given > 1 + 1e-9:
        raise ValueError(f"schedule {spec!r}: shares sum to {given:g}, more than the whole budget")
    rest = [m for m, v in phases if v is None]
    fill = (1 - given) / len(rest) if rest else 0.0
    if rest and fill <= 1e-9:
        raise ValueError(f"schedule {spec!r}: the given shares leave nothing for the other phases")
    return [(m, fill if v is None else v) for m, v in phases]


def schedule_label(spec: str) -> str:
    """A model label for a composition: ``es-grpo`` (phase ``i`` done: ``es-grpo.i``)."""
    return "-".join(m for m, _ in parse_schedule(spec))


def phase_budget(cc: CompareConfig, method: str, share: float) -> int:
    """ES iterations or GRPO steps of a phase with ``share`` of the rollout budget (at least 1)."""
    whole = cc.iterations if method == "es" else cc.grpo_steps()
    return max(1, round(share * whole))


def run_schedule(
    base_dir: str, out_dir: str, spec: str, cc: CompareConfig, echo=print, probe=None
) -> tuple[dict, dict]:
    """Train the phases of ``spec`` one after the other from ``base_dir``; each phase starts from the
    previous one's model.  Returns (summed budget, {label: checkpoint directory of every phase})."""
    label = schedule_label(spec)
    total = {"rollouts": 0, "prompt_tokens": 0, "generated_tokens": 0, "seconds": 0.0, "train_reward": []}
    total["train_entropy"] = []  # GRPO phases: (phase, step, bits)
    total["probe_entropy"] = []  # every phase: (phase, step, bits)
    checkpoints, start = {}, base_dir
    phases = parse_schedule(spec)
    for i, (method, share) in enumerate(phases, 1):
        out = os.path.join(out_dir, f"{i}-{method}")
        n = phase_budget(cc, method, share)
        echo(
            f"[compare] {label} phase {i}/{len(phases)}: {method} for {n} {'iterations' if method == 'es' else 'steps'}"
        )
        if method == "es":
            b = run_es(start, out, cc, echo, iterations=n, probe=probe)
        else:
            b = run_grpo(start, out, cc, echo, steps=n, probe=probe)
        for key in ("rollouts", "prompt_tokens", "generated_tokens", "seconds"):
            total[key] += b[key]
        total["train_reward"] += b["train_reward"]
        total["train_entropy"] += [(i, step, h) for step, h in b.get("train_entropy", [])]
        total["probe_entropy"] += [(i, step, h) for step, h in b["probe_entropy"]]
        checkpoints[label if i == len(phases) else f"{label}.{i}"] = out
        start = out
    total["seconds"] = round(total["seconds"], 1)
    return total, checkpoints


def _token_counter(tokenizer, max_new_tokens: int):
    """count(completion texts) -> generated tokens, the same rule for both methods: the completion's
    token ids plus the end token when generation stopped before ``max_new_tokens``."""

    def count(texts: Sequence[str]) -> int:
        total = 0
        for t in texts:
            k = len(tokenizer(t, add_special_tokens=False).input_ids)
            total += min(k + 1, max_new_tokens)
        return total

    return count


def load_tasks(cc: CompareConfig):
    """(training problems, held-out problems) of ``cc.task``, read the way ``espert train`` reads them."""
    from espert.tasks.resolve import load_spec_task

    train = load_spec_task(cc.task, "train", n=cc.train_size, path=cc.train_data)
    test = load_spec_task(cc.task, "test", n=cc.eval_size, path=cc.eval_data)
    for split, t in (("training", train), ("held-out", test)):
        if t is None or len(t) == 0:
            raise ValueError(f"task {cc.task!r} has no {split} problems")
    return train, test


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
    base_dir: str, out_dir: str, cc: CompareConfig, echo=print, iterations: Optional[int] = None, probe=None
) -> dict:
    """ES on ``cc.task`` from ``base_dir`` for ``iterations`` (default ``cc.iterations``) on
    ``cc.evaluator``; exports the final center to ``out_dir`` in the base's format; returns the budget
    (with ``probe_entropy``: ``[(iteration, bits)]`` when a :class:`Probe` is given)."""
    if iterations is not None:
        cc = dataclasses.replace(cc, iterations=iterations)
    from transformers import AutoTokenizer

    from espert.config import ESConfig
    from espert.es import es_step, prompt_indices
    from espert.evaluators import build_evaluator
    from espert.runs.export import export_model

    train, _ = load_tasks(cc)
    tok = AutoTokenizer.from_pretrained(base_dir)
    count = _token_counter(tok, cc.max_new_tokens)
    budget = {"rollouts": 0, "prompt_tokens": 0, "generated_tokens": 0}

    def score(completions, answers):
        budget["rollouts"] += len(completions)
        budget["generated_tokens"] += count(completions)
        return train.score(completions, answers)

    cfg = ESConfig(
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
    )
    ev = build_evaluator(cfg, base_dir, score)
    t0 = time.time()
    curve, entropy = [], []
    due = set(probe_steps(cc.iterations, cc.probe_points)) if probe else set()
    try:
        if 0 in due:
            entropy.append((0, probe(ev.export_state())))
        for t in range(1, cc.iterations + 1):
            idx = prompt_indices(cfg, t, len(train))
            prompts = [train.prompts[i] for i in idx]
            budget["prompt_tokens"] += cc.population * sum(
                len(tok(chat_prompt(tok, p) if cc.chat_template else p).input_ids) for p in prompts
            )
            rec = es_step(ev, cfg, t, prompts, [train.answers[i] for i in idx])
            curve.append(rec["reward"]["mean"])
            if t in due:
                entropy.append((t, probe(ev.export_state())))
            if echo and (t % max(1, cc.iterations // 5) == 0 or t == cc.iterations):
                echo(f"[compare] ES iteration {t}/{cc.iterations}: mean member reward {rec['reward']['mean']:.3f}")
        stream = ev.center_stream()  # vLLM: chunk by chunk from the workers; torch: the dict
        export_model(ev.export_state() if stream is None else stream, base_dir, out_dir)
    finally:
        ev.close()
    budget.update(seconds=round(time.time() - t0, 1), train_reward=curve, probe_entropy=entropy)
    return budget


def run_grpo(
    base_dir: str, out_dir: str, cc: CompareConfig, echo=print, steps: Optional[int] = None, probe=None
) -> dict:
    """GRPO (``trl.GRPOTrainer``) on ``cc.task`` from ``base_dir`` for ``steps`` optimizer steps (default:
    ES's rollout budget, :meth:`CompareConfig.grpo_steps`); saves to ``out_dir``.  With ``cc.chat_template``
    the prompts are TRL's conversational ones, so TRL applies the same template as ES and eval."""
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    train, _ = load_tasks(cc)
    tok = AutoTokenizer.from_pretrained(base_dir)
    count = _token_counter(tok, cc.max_new_tokens)
    budget = {"rollouts": 0, "prompt_tokens": 0, "generated_tokens": 0}
    curve = []

    def task_reward(prompts, completions, answer, **kw):
        # conversational completions are [{"role": "assistant", "content": text}]
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        budget["rollouts"] += len(texts)
        budget["generated_tokens"] += count(texts)
        budget["prompt_tokens"] += sum(
            len(tok(p if isinstance(p, str) else chat_prompt(tok, p[-1]["content"])).input_ids) for p in prompts
        )
        r = train.score(texts, answer)
        curve.append(sum(r) / len(r))
        return r

    steps = cc.grpo_steps() if steps is None else steps
    entropy = []
    due = set(probe_steps(steps, cc.probe_points)) if probe else set()

    class ProbeCallback(TrainerCallback):
        """The policy's probe-set token entropy at the due steps (step 0: before the first update)."""

        def on_train_begin(self, args, state, control, model=None, **kw):
            if 0 in due:
                entropy.append((0, probe(model.state_dict())))

        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step in due:
                entropy.append((state.global_step, probe(model.state_dict())))

    args = GRPOConfig(
        output_dir=os.path.join(out_dir, "_trl"),
        max_steps=steps,
        learning_rate=cc.learning_rate,
        per_device_train_batch_size=cc.num_generations * cc.prompts_per_step,
        num_generations=cc.num_generations,
        max_completion_length=cc.max_new_tokens,
        temperature=cc.temperature,
        beta=0.0,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=max(1, steps // 5),
        seed=cc.seed,
        disable_tqdm=True,
        bf16=False,
        dataloader_num_workers=0,
    )
    prompts = [[{"role": "user", "content": p}] if cc.chat_template else p for p in train.prompts]
    data = Dataset.from_dict({"prompt": prompts, "answer": train.answers})
    trainer = GRPOTrainer(
        model=base_dir,
        reward_funcs=[task_reward],
        args=args,
        train_dataset=data,
        processing_class=tok,
        callbacks=[ProbeCallback()],
    )
    t0 = time.time()
    trainer.train()
    trainer.model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    if echo:
        echo(f"[compare] GRPO: {steps} steps, last mean reward {curve[-1]:.3f}")
    # TRL's own token entropy of the policy on its sampled completions (nats), at each logging step:
    # GRPO's entropy during training, in bits
    own = [(h["step"], h["entropy"] / math.log(2)) for h in trainer.state.log_history if "entropy" in h]
    budget.update(
        seconds=round(time.time() - t0, 1), steps=steps, train_reward=curve, train_entropy=own, probe_entropy=entropy
    )
    return budget


def evaluate(models: dict[str, str], out_dir: str, cc: CompareConfig, echo=print) -> dict:
    """``espert eval`` of every model on the held-out problems (``cc.evaluator``'s sampler); writes
    report.json and PNGs."""
    from espert.eval.runner import generate_samples, write_outputs
    from espert.eval.samplers import make_sampler
    from espert.eval.samples import save_samples

    _, task = load_tasks(cc)
    groups = {}
    for label, path in models.items():
        sampler = make_sampler(cc.evaluator, path, device="cpu", batch_size=256, chat_template=cc.chat_template)
        try:
            recs = generate_samples(
                task,
                label,
                sampler,
                cc.n,
                cc.temperature,
                1.0,
                cc.max_new_tokens,
                cc.seed,
                extra_meta={"model_path": path},
            )
        finally:
            sampler.close()
        save_samples(os.path.join(out_dir, f"samples_{label}.jsonl"), recs)
        groups[label] = recs
    return write_outputs(groups, out_dir, base="base", threshold=1.0, solve_rule="any", echo=echo or (lambda s: None))


def n_params(model_dir: str) -> int:
    from espert.eval.analyze import SafetensorsWeights

    w = SafetensorsWeights(model_dir)
    total = 0
    for name in w.names():
        k = 1
        for s in w.shape(name):
            k *= s
        total += k
    return total


def _budget_lines(budgets: dict, P: int) -> list[str]:
    from espert.diagnostics import forward_flops

    lines = [
        "| method | rollouts | prompt tokens | generated tokens | rollout forward FLOPs | wall s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for lab, b in budgets.items():
        fl = forward_flops(P, b["prompt_tokens"] + b["generated_tokens"])
        b["rollout_forward_flops"] = fl
        lines.append(
            f"| {lab} | {b['rollouts']} | {b['prompt_tokens']} | {b['generated_tokens']} | {fl:.3e} | {b['seconds']} |"
        )
    return lines


def base_model(out_dir: str, cc: CompareConfig, echo=print) -> tuple[str, str]:
    """(directory of the base model, its description for the report): ``OUT/base`` built for 'tiny',
    else the model ``espert train --model`` would load (a GGUF: its converted directory)."""
    from espert.runs import resolve_model_dir
    from espert.runs.gguf import gguf_path

    if cc.model == "tiny":
        from espert.tiny import build_tiny_model

        base, t0 = os.path.join(out_dir, "base"), time.time()
        build_tiny_model(base, seed=cc.tiny_seed, pretrain_steps=cc.pretrain_steps, pretrain_lr=cc.pretrain_lr)
        echo(f"[compare] base: tiny model pretrained {cc.pretrain_steps} steps ({time.time() - t0:.0f} s)")
        return base, "tiny model"
    gguf = gguf_path(cc.model)
    base = resolve_model_dir(gguf or cc.model, echo)
    echo(f"[compare] base: {cc.model} ({base})")
    return base, f"`{cc.model}`"


def _entropy_table(budgets: dict) -> list[str]:
    """Markdown rows: each method's probe entropy at its probed steps (phase.step for compositions)."""
    lines = ["| method | probe-set token entropy (bits) at step |", "|---|---|"]
    for lab, b in budgets.items():
        cells = []
        for p in b["probe_entropy"]:
            step = f"{p[0]}.{p[1]}" if len(p) == 3 else str(p[0])
            cells.append(f"{step}: {p[-1]:.3f}")
        lines.append(f"| {lab} | {', '.join(cells)} |")
    return lines


def entropy_curves(probes: dict, schedules: dict) -> dict[str, list[tuple[float, float]]]:
    """label -> [(share of the rollout budget spent, bits)] from the probes ``[(step, bits)]`` of a
    method, or ``[(phase, step, bits)]`` of a composition (``schedules``: label -> [(method, share)]),
    so that every method's curve spans 0..1 of the same budget."""
    curves = {}
    for lab, pts in probes.items():
        if not pts:
            continue
        if len(pts[0]) == 2:
            last = pts[-1][0] or 1
            curves[lab] = [(step / last, h) for step, h in pts]
            continue
        shares = [share for _, share in schedules[lab]]
        ends = {}
        for phase, step, _ in pts:
            ends[phase] = max(ends.get(phase, 0), step)
        curves[lab] = [
            (sum(shares[: phase - 1]) + shares[phase - 1] * step / (ends[phase] or 1), h) for phase, step, h in pts
        ]
    return curves


def run_compare(out_dir: str, cc: CompareConfig, echo=print) -> dict:
    """The whole comparison; returns the ``compare.json`` document.  The packages it needs, every
    schedule and the task's problems are checked before anything is trained or written."""
    for module in ("trl", "accelerate", "datasets", "matplotlib"):
        require(module, "espert compare")
    if cc.evaluator == "vllm":
        require("vllm", "espert compare --evaluator vllm")
    elif cc.evaluator != "torch":
        raise ValueError(f"evaluator {cc.evaluator!r}: use torch or vllm")
    for spec in cc.schedules:
        parse_schedule(spec)
    _, heldout = load_tasks(cc)
    from espert.eval.analyze import compute_drift, format_drift_summary, plot_drift
    from espert.eval.report import format_summary

    os.makedirs(out_dir, exist_ok=True)
    base, described = base_model(out_dir, cc, echo)
    probe = Probe(base, heldout.prompts, cc)
    budgets = {
        "ES": run_es(base, os.path.join(out_dir, "es"), cc, echo, probe=probe),
        "GRPO": run_grpo(base, os.path.join(out_dir, "grpo"), cc, echo, probe=probe),
    }
    models = {"base": base, "es": os.path.join(out_dir, "es"), "grpo": os.path.join(out_dir, "grpo")}
    for spec in cc.schedules:
        label = schedule_label(spec)
        budgets[label], phases = run_schedule(base, os.path.join(out_dir, label), spec, cc, echo, probe=probe)
        models.update(phases)
    report = evaluate(models, os.path.join(out_dir, "eval"), cc, echo)
    entropy = {label: probe.of_dir(path) for label, path in models.items()}
    probe.close()
    drift = {lab: compute_drift(base, path, per_tensor=False) for lab, path in models.items() if lab != "base"}
    plot_drift(drift, os.path.join(out_dir, "eval"))
    from espert.eval.plots import plot_lines

    schedules = {schedule_label(sp): parse_schedule(sp) for sp in cc.schedules}
    plot_lines(
        entropy_curves({k: v["probe_entropy"] for k, v in budgets.items()}, schedules),
        os.path.join(out_dir, "eval", "probe_entropy.png"),
        "share of the rollout budget spent",
        "token entropy (bits)",
        "probe-set token entropy during training",
    )
    P = n_params(base)
    lines = [
        f"# ES vs GRPO on `{cc.task}` ({described}, {P} parameters)",
        "",
        f"Config: `{json.dumps(dataclasses.asdict(cc))}`",
        "",
        "## Budget",
        "",
    ]
    lines += _budget_lines(budgets, P)
    lines += [
        "",
        "## Held-out evaluation (espert eval)",
        "",
        "```",
        format_summary(report),
        "```",
        "",
        "## Token entropy (greedy, held-out prompts, bits per token)",
        "",
        "| model | " + " | ".join(entropy) + " |",
        "|---" * (len(entropy) + 1) + "|",
        "| H | " + " | ".join(f"{h:.3f}" for h in entropy.values()) + " |",
        "",
        "During training (the same probe, at equally spaced steps of each method's budget):",
        "",
    ]
    lines += _entropy_table(budgets)
    lines += ["", "## Drift (espert analyze)", "", "```"]
    lines += [format_drift_summary(lab, d) for lab, d in drift.items()]
    lines += ["```", ""]
    text = "\n".join(lines)
    with open(os.path.join(out_dir, "report.md"), "w", encoding="utf-8") as f:
        f.write(text)
    per_run = ("train_reward", "train_entropy", "probe_entropy")
    doc = {
        "config": dataclasses.asdict(cc),
        "base": base,
        "n_params": P,
        "budgets": {k: {kk: vv for kk, vv in v.items() if kk not in per_run} for k, v in budgets.items()},
        "train_reward": {k: v["train_reward"] for k, v in budgets.items()},
        "eval": report["models"],
        "comparisons": report["comparisons"],
        "pareto": report["pareto"],
        "token_entropy": entropy,
        "probe_entropy": {k: v["probe_entropy"] for k, v in budgets.items()},
        "grpo_train_entropy": {k: v["train_entropy"] for k, v in budgets.items() if v.get("train_entropy")},
        "schedules": schedules,
        "drift": {k: {"overall": v["overall"], "groups": v["groups"]} for k, v in drift.items()},
    }
    from espert.runs.files import atomic_write_text  # whole or not at all (a full disk keeps the old file)

    atomic_write_text(os.path.join(out_dir, "compare.json"), json.dumps(doc, indent=2) + "\n")
    echo(text)
    return doc


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/compare", metavar="DIR", help="output directory (default runs/compare)")
    p.add_argument("--fast", action="store_true", help="the small CI variant (about a minute)")
    p.add_argument(
        "--schedule",
        action="append",
        default=[],
        metavar="PHASES",
        help="also train a sequential composition, e.g. es,grpo or grpo:0.25,es:0.75 (phases share the "
        "rollout budget of ES alone: equally unless given); repeatable; every phase's model is evaluated "
        "(default: none, ES and GRPO alone)",
    )
    full, fast = CompareConfig(), CompareConfig.fast()
    for f in dataclasses.fields(CompareConfig):
        if f.name == "schedules":
            continue
        value, small = getattr(full, f.name), getattr(fast, f.name)
        what = _HELP[f.name]
        shown = f"default {value}" + (f"; --fast: {small}" if small != value else "")
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            p.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=f"{what} ({shown})"
            )
        else:
            kind = type(value) if value is not None else str
            p.add_argument(
                flag, type=kind, default=argparse.SUPPRESS, metavar=kind.__name__.upper(), help=f"{what} ({shown})"
            )
    p.set_defaults(func=run_cli)


#: help of the CompareConfig fields that say what is compared (the rest are sizes)
_HELP = {
    "model": "base model: 'tiny' (built locally) or what `espert train --model` takes (a directory, a Hub id, "
    "a GGUF file, smollm2-135m-instruct)",
    "task": "task, as `espert train --task` (a built-in name or an import path)",
    "train_data": "local JSONL of training problems, as `espert train --train-data`",
    "eval_data": "local JSONL of held-out problems, as `espert train --eval-data`",
    "chat_template": "wrap prompts in the tokenizer's chat template (ES, GRPO and eval alike)",
    "evaluator": "ES rollouts and held-out sampling: torch or vllm (GRPO uses TRL's generate)",
    "tiny_seed": "model tiny: seed of its initialization and pretraining",
    "pretrain_steps": "model tiny: pretraining steps",
    "pretrain_lr": "model tiny: pretraining learning rate",
    "train_size": "training prompt pool (problems)",
    "eval_size": "held-out problems (evaluation and the token-entropy probe)",
    "n": "samples per held-out problem",
    "temperature": "sampling temperature of the held-out evaluation and of GRPO's rollouts",
    "max_new_tokens": "generation budget per completion (every method)",
    "iterations": "ES iterations (GRPO gets steps for the same rollouts)",
    "population": "ES members per iteration",
    "prompts_per_iteration": "ES training prompts per iteration",
    "sigma": "ES perturbation scale",
    "alpha": "ES step size",
    "num_generations": "GRPO completions per prompt (the group)",
    "prompts_per_step": "GRPO prompts per optimizer step",
    "learning_rate": "GRPO learning rate (Adam)",
    "seed": "seed of both methods and of sampling",
    "probe_points": "token entropy on the probe set at this many equal steps of each method's training (+ the start)",
}


def add_compare_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``espert compare`` to an argparse ``subparsers`` object; sets ``func``."""
    p = subparsers.add_parser(
        "compare",
        help="ES vs GRPO (trl) end to end on one base model and task: budgets, "
        "pass@k/maj@k, coverage, drift (needs espert[compare])",
        description=__doc__.split("\n\n")[0],
    )
    _add_arguments(p)
    return p


def run_cli(args: argparse.Namespace) -> int:
    """Entry point of ``espert compare``: 0, or 2 with a one-line error (e.g. TRL missing)."""
    import torch

    threads = torch.get_num_threads()
    try:
        cc = CompareConfig.fast() if args.fast else CompareConfig()
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cc) if hasattr(args, f.name)}
        given.pop("schedules", None)
        cc = dataclasses.replace(cc, schedules=tuple(args.schedule), **given)
        torch.set_num_threads(1)
        run_compare(args.out, cc, echo=lambda s: print(s, file=sys.stderr))
    except (ImportError, ValueError, FileNotFoundError) as e:
        print(f"espert compare: error: {e}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)  # a caller's process (tests, notebooks) keeps its thread count
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m espert.compare", description=__doc__.split("\n\n")[0])
    _add_arguments(p)
    return run_cli(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
