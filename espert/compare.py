"""ES against GRPO on one machine: the seed papers' comparison in miniature.

    espert compare --out runs/compare           # full run (8 minutes on a loaded 2-core machine)
    espert compare --out runs/compare --fast    # the CI variant (about a minute)

(``python -m espert.compare`` is the same command.)

One base model (the tiny model pretrained locally, :func:`espert.tiny.build_tiny_model`), one
task (the built-in ``copy``), one reward, one training prompt pool, one rollout budget:

1. **ES**: espert's :func:`espert.es.es_step` on the torch evaluator (greedy rollouts of perturbed
   members), ``iterations × population × prompts_per_iteration`` rollouts.
2. **GRPO**: ``trl.GRPOTrainer`` (sampled rollouts, ``num_generations`` per prompt, no KL term),
   as many optimizer steps as give the same number of rollouts.
3. **Evaluation**: base, ES and GRPO with ``espert eval`` (``n`` samples per held-out problem,
   temperature sampling): pass@k and maj@k curves, the 12-bin coverage histograms, progressions
   and regressions against the base, answer entropy.
4. **Drift**: ``espert analyze`` drift of both fine-tuned models against the base.

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


#: What the two methods are compared on (model, task, budget).  Defaults: the full run.
@dataclass
class CompareConfig:
    """Sizes of the comparison.  ``fast()`` gives the CI variant."""

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


def run_schedule(base_dir: str, out_dir: str, spec: str, cc: CompareConfig, echo=print) -> tuple[dict, dict]:
    """Train the phases of ``spec`` one after the other from ``base_dir``; each phase starts from the
    previous one's model.  Returns (summed budget, {label: checkpoint directory of every phase})."""
    label = schedule_label(spec)
    total = {"rollouts": 0, "prompt_tokens": 0, "generated_tokens": 0, "seconds": 0.0, "train_reward": []}
    total["train_entropy"] = []  # GRPO phases: (phase, step, bits)
    checkpoints, start = {}, base_dir
    phases = parse_schedule(spec)
    for i, (method, share) in enumerate(phases, 1):
        out = os.path.join(out_dir, f"{i}-{method}")
        n = phase_budget(cc, method, share)
        echo(
            f"[compare] {label} phase {i}/{len(phases)}: {method} for {n} {'iterations' if method == 'es' else 'steps'}"
        )
        b = run_es(start, out, cc, echo, iterations=n) if method == "es" else run_grpo(start, out, cc, echo, steps=n)
        for key in ("rollouts", "prompt_tokens", "generated_tokens", "seconds"):
            total[key] += b[key]
        total["train_reward"] += b["train_reward"]
        total["train_entropy"] += [(i, step, h) for step, h in b.get("train_entropy", [])]
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


def run_es(base_dir: str, out_dir: str, cc: CompareConfig, echo=print, iterations: Optional[int] = None) -> dict:
    """ES on ``copy`` from ``base_dir`` for ``iterations`` (default ``cc.iterations``); saves the final
    model to ``out_dir``; returns the budget."""
    if iterations is not None:
        cc = dataclasses.replace(cc, iterations=iterations)
    import torch

    from espert.config import ESConfig
    from espert.es import es_step, prompt_indices
    from espert.evaluators import TorchEvaluator, load_model
    from espert.tasks import load_task

    train = load_task("copy", "train", n=cc.train_size)
    model, tok = load_model(base_dir)
    count = _token_counter(tok, cc.max_new_tokens)
    budget = {"rollouts": 0, "prompt_tokens": 0, "generated_tokens": 0}

    def score(completions, answers):
        budget["rollouts"] += len(completions)
        budget["generated_tokens"] += count(completions)
        return train.score(completions, answers)

    cfg = ESConfig(
        model=base_dir,
        iterations=cc.iterations,
        population=cc.population,
        prompts_per_iteration=cc.prompts_per_iteration,
        sigma=cc.sigma,
        alpha=cc.alpha,
        seed=cc.seed,
        max_new_tokens=cc.max_new_tokens,
        eval_size=0,
    )
    ev = TorchEvaluator(model, tok, score, max_new_tokens=cc.max_new_tokens)
    t0 = time.time()
    curve = []
    try:
        for t in range(1, cc.iterations + 1):
            idx = prompt_indices(cfg, t, len(train))
            prompts = [train.prompts[i] for i in idx]
            budget["prompt_tokens"] += cc.population * sum(len(tok(p).input_ids) for p in prompts)
            rec = es_step(ev, cfg, t, prompts, [train.answers[i] for i in idx])
            curve.append(rec["reward"]["mean"])
            if echo and (t % max(1, cc.iterations // 5) == 0 or t == cc.iterations):
                echo(f"[compare] ES iteration {t}/{cc.iterations}: mean member reward {rec['reward']['mean']:.3f}")
        with torch.no_grad():
            model.save_pretrained(out_dir, safe_serialization=True)
        tok.save_pretrained(out_dir)
    finally:
        ev.close()
    budget.update(seconds=round(time.time() - t0, 1), train_reward=curve)
    return budget


def run_grpo(base_dir: str, out_dir: str, cc: CompareConfig, echo=print, steps: Optional[int] = None) -> dict:
    """GRPO (``trl.GRPOTrainer``) on ``copy`` from ``base_dir`` for ``steps`` optimizer steps (default:
    ES's rollout budget, :meth:`CompareConfig.grpo_steps`); saves to ``out_dir``."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from espert.tasks import load_task

    train = load_task("copy", "train", n=cc.train_size)
    tok = AutoTokenizer.from_pretrained(base_dir)
    count = _token_counter(tok, cc.max_new_tokens)
    budget = {"rollouts": 0, "prompt_tokens": 0, "generated_tokens": 0}
    curve = []

    def copy_reward(prompts, completions, answer, **kw):
        budget["rollouts"] += len(completions)
        budget["generated_tokens"] += count(completions)
        budget["prompt_tokens"] += sum(len(tok(p).input_ids) for p in prompts)
        r = train.score(completions, answer)
        curve.append(sum(r) / len(r))
        return r

    steps = cc.grpo_steps() if steps is None else steps
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
    data = Dataset.from_dict({"prompt": train.prompts, "answer": train.answers})
    trainer = GRPOTrainer(
        model=base_dir, reward_funcs=[copy_reward], args=args, train_dataset=data, processing_class=tok
    )
    t0 = time.time()
    trainer.train()
    trainer.model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    if echo:
        echo(f"[compare] GRPO: {steps} steps, last mean reward {curve[-1]:.3f}")
    # TRL's own token entropy of the policy on its sampled completions (nats), at each logging step:
    # GRPO's entropy during training, in bits
    entropy = [(h["step"], h["entropy"] / math.log(2)) for h in trainer.state.log_history if "entropy" in h]
    budget.update(seconds=round(time.time() - t0, 1), steps=steps, train_reward=curve, train_entropy=entropy)
    return budget


def evaluate(models: dict[str, str], out_dir: str, cc: CompareConfig, echo=print) -> dict:
    """``espert eval`` of every model on the held-out copy problems; writes report.json and PNGs."""
    from espert.eval.runner import generate_samples, write_outputs
    from espert.eval.samplers import TransformersSampler
    from espert.eval.samples import save_samples
    from espert.tasks import load_task

    task = load_task("copy", "test", n=cc.eval_size)
    groups = {}
    for label, path in models.items():
        sampler = TransformersSampler(path, device="cpu", batch_size=256)
        recs = generate_samples(
            task, label, sampler, cc.n, cc.temperature, 1.0, cc.max_new_tokens, cc.seed, extra_meta={"model_path": path}
        )
        save_samples(os.path.join(out_dir, f"samples_{label}.jsonl"), recs)
        groups[label] = recs
    return write_outputs(groups, out_dir, base="base", threshold=1.0, solve_rule="any", echo=echo or (lambda s: None))


def token_entropies(models: dict[str, str], cc: CompareConfig) -> dict[str, float]:
    """label -> mean token entropy (bits) of the model's next-token distribution along its greedy
    completions of the held-out prompts (the probe set; :meth:`TorchEvaluator.evaluate_center`), the
    same measure ES runs log at every held-out evaluation."""
    from espert.evaluators import TorchEvaluator, load_model
    from espert.tasks import load_task

    task = load_task("copy", "test", n=cc.eval_size)
    out = {}
    for label, path in models.items():
        model, tok = load_model(path)
        ev = TorchEvaluator(model, tok, lambda c, a: [0.0] * len(c), max_new_tokens=cc.max_new_tokens)
        ev.evaluate_center(task.prompts, task.answers)
        out[label] = ev.last_token_entropy
        ev.close()
    return out


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


def run_compare(out_dir: str, cc: CompareConfig, echo=print) -> dict:
    """The whole comparison; returns the ``compare.json`` document.  The packages it needs and every
    schedule are checked before anything is built or written."""
    for module in ("trl", "accelerate", "datasets", "matplotlib"):
        require(module, "espert compare")
    for spec in cc.schedules:
        parse_schedule(spec)
    from espert.eval.analyze import compute_drift, format_drift_summary, plot_drift
    from espert.eval.report import format_summary
    from espert.tiny import build_tiny_model

    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, "base")
    t0 = time.time()
    build_tiny_model(base, seed=cc.tiny_seed, pretrain_steps=cc.pretrain_steps, pretrain_lr=cc.pretrain_lr)
    echo(f"[compare] base: tiny model pretrained {cc.pretrain_steps} steps ({time.time() - t0:.0f} s)")
    budgets = {
        "ES": run_es(base, os.path.join(out_dir, "es"), cc, echo),
        "GRPO": run_grpo(base, os.path.join(out_dir, "grpo"), cc, echo),
    }
    models = {"base": base, "es": os.path.join(out_dir, "es"), "grpo": os.path.join(out_dir, "grpo")}
    for spec in cc.schedules:
        label = schedule_label(spec)
        budgets[label], phases = run_schedule(base, os.path.join(out_dir, label), spec, cc, echo)
        models.update(phases)
    report = evaluate(models, os.path.join(out_dir, "eval"), cc, echo)
    entropy = token_entropies(models, cc)
    drift = {lab: compute_drift(base, path, per_tensor=False) for lab, path in models.items() if lab != "base"}
    plot_drift(drift, os.path.join(out_dir, "eval"))
    P = n_params(base)
    lines = [
        f"# ES vs GRPO on `copy` (tiny model, {P} parameters)",
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
        "## Drift (espert analyze)",
        "",
        "```",
    ]
    lines += [format_drift_summary(lab, d) for lab, d in drift.items()]
    lines += ["```", ""]
    text = "\n".join(lines)
    with open(os.path.join(out_dir, "report.md"), "w", encoding="utf-8") as f:
        f.write(text)
    doc = {
        "config": dataclasses.asdict(cc),
        "n_params": P,
        "budgets": {
            k: {kk: vv for kk, vv in v.items() if kk not in ("train_reward", "train_entropy")}
            for k, v in budgets.items()
        },
        "train_reward": {k: v["train_reward"] for k, v in budgets.items()},
        "eval": report["models"],
        "comparisons": report["comparisons"],
        "pareto": report["pareto"],
        "token_entropy": entropy,
        "grpo_train_entropy": {k: v["train_entropy"] for k, v in budgets.items() if v.get("train_entropy")},
        "schedules": {schedule_label(sp): parse_schedule(sp) for sp in cc.schedules},
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
    p.set_defaults(func=run_cli)


def add_compare_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``espert compare`` to an argparse ``subparsers`` object; sets ``func``."""
    p = subparsers.add_parser(
        "compare",
        help="ES vs GRPO (trl) end to end on the tiny model: budgets, "
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
        cc = dataclasses.replace(cc, schedules=tuple(args.schedule))
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
