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

TRL is an optional extra (``pip install espert[compare]``); without it this module raises a clear
``ImportError`` at :func:`run_grpo`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence


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


def run_es(base_dir: str, out_dir: str, cc: CompareConfig, echo=print) -> dict:
    """ES on ``copy`` from ``base_dir``; saves the final model to ``out_dir``; returns the budget."""
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


def run_grpo(base_dir: str, out_dir: str, cc: CompareConfig, echo=print) -> dict:
    """GRPO (``trl.GRPOTrainer``) on ``copy`` from ``base_dir`` with ES's rollout budget; saves to ``out_dir``."""
    try:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise ImportError(f"the ES-vs-GRPO comparison needs TRL: pip install 'espert[compare]' ({e})") from None
    from transformers import AutoTokenizer

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

    steps = cc.grpo_steps()
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
    budget.update(seconds=round(time.time() - t0, 1), steps=steps, train_reward=curve)
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
    """The whole comparison; returns the ``compare.json`` document."""
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
    report = evaluate(models, os.path.join(out_dir, "eval"), cc, echo)
    drift = {lab: compute_drift(base, models[lab], per_tensor=False) for lab in ("es", "grpo")}
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
        "budgets": {k: {kk: vv for kk, vv in v.items() if kk != "train_reward"} for k, v in budgets.items()},
        "train_reward": {k: v["train_reward"] for k, v in budgets.items()},
        "eval": report["models"],
        "comparisons": report["comparisons"],
        "drift": {k: {"overall": v["overall"], "groups": v["groups"]} for k, v in drift.items()},
    }
    from espert.runs.files import atomic_write_text  # whole or not at all (a full disk keeps the old file)

    atomic_write_text(os.path.join(out_dir, "compare.json"), json.dumps(doc, indent=2) + "\n")
    echo(text)
    return doc


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/compare", metavar="DIR", help="output directory (default runs/compare)")
    p.add_argument("--fast", action="store_true", help="the small CI variant (about a minute)")
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

    cc = CompareConfig.fast() if args.fast else CompareConfig()
    threads = torch.get_num_threads()
    try:
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
