"""What ``espert compare`` compares and at which size: :class:`CompareConfig` (every field is a flag),
the budget every method trains until it has spent (:class:`Budget`), the sequential compositions of ES
and GRPO (``--schedule``), and the task's problems."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional

#: What a method's training is stopped by: its rollouts, its tokens (prompt + generated, the forward
#: passes' input) or its wall-clock seconds of training (model loading and engine start excluded).
BUDGETS = ("rollouts", "tokens", "seconds")
#: The methods ``--methods`` may name (labels in the report: ES, ES+AWD, GRPO, RandOpt).
ARMS = {"es": "ES", "es_awd": "ES+AWD", "grpo": "GRPO", "randopt": "RandOpt"}


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
    # the budget every method trains until it has spent (budget_value 0: ES's rollouts, iterations ×
    # population × prompts_per_iteration; tokens and seconds need a value)
    budget: str = "rollouts"
    budget_value: float = 0.0
    methods: str = "es,grpo"  # comma-separated: es, es_awd, grpo, randopt
    # ES+AWD: anchored weight decay toward the base (lambda, norm)
    anchor_decay: float = 10.0
    anchor_decay_norm: str = "l2"
    # RandOpt: the sigma grid and the ensemble's size (members are scored on prompts_per_iteration prompts)
    randopt_sigmas: str = "5e-4,1e-3,2e-3"
    randopt_top_k: int = 8
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

    def arms(self) -> list[str]:
        """The methods to train, checked: names of :data:`ARMS`, each once."""
        arms = [m.strip() for m in self.methods.split(",") if m.strip()]
        bad = [m for m in arms if m not in ARMS]
        if bad or not arms or len(set(arms)) < len(arms):
            raise ValueError(f"--methods {self.methods!r}: name each of {', '.join(ARMS)} at most once")
        return arms


@dataclass(frozen=True)
class Budget:
    """What every method trains until it has spent: ``kind`` (:data:`BUDGETS`) and its ``value``.  A method
    checks it after each iteration, step or window of members, so it stops at the first check past the
    value (the report states what each one spent)."""

    kind: str
    value: float

    @classmethod
    def of(cls, cc: CompareConfig) -> "Budget":
        if cc.budget not in BUDGETS:
            raise ValueError(f"--budget {cc.budget!r}: use one of {', '.join(BUDGETS)}")
        value = cc.budget_value or (cc.es_rollouts() if cc.budget == "rollouts" else 0.0)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"--budget {cc.budget} needs --budget-value > 0, got {cc.budget_value}")
        return cls(cc.budget, float(value))

    def spent(self, used: dict, t0: float) -> float:
        """What ``used`` (rollouts, prompt_tokens, generated_tokens) and the clock since ``t0`` have spent of it."""
        if self.kind == "rollouts":
            return used["rollouts"]
        if self.kind == "tokens":
            return used["prompt_tokens"] + used["generated_tokens"]
        return time.time() - t0

    def done(self, used: dict, t0: float) -> bool:
        return self.spent(used, t0) >= self.value

    def steps(self, per_step: int) -> int | None:
        """Steps of ``per_step`` rollouts that spend a rollout budget (rounded up); None for the others."""
        return math.ceil(self.value / per_step) if self.kind == "rollouts" else None


#: fields that may be 0 (every other number must be >= 1, a float > 0)
MAY_BE_ZERO = ("tiny_seed", "pretrain_steps", "seed", "probe_points", "temperature", "budget_value", "anchor_decay")


def check_numbers(cc: CompareConfig) -> None:
    """ValueError naming the first number of ``cc`` out of range (NaN and infinities too), before anything
    is built or written."""
    import math

    for name, value in vars(cc).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        least = 0 if name in MAY_BE_ZERO else 1
        if isinstance(value, float) and not (math.isfinite(value) and (value > 0 or (least == 0 and value == 0))):
            bound = ">= 0" if least == 0 else "> 0"
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number {bound}, got {value}")
        if isinstance(value, int) and not least <= value < 2**63:
            raise ValueError(f"--{name.replace('_', '-')} must be in [{least}, 2^63), got {value}")


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


def load_tasks(cc: CompareConfig):
    """(training problems, held-out problems) of ``cc.task``, read the way ``espert train`` reads them."""
    from espert.tasks.resolve import load_spec_task

    train = load_spec_task(cc.task, "train", n=cc.train_size, path=cc.train_data)
    test = load_spec_task(cc.task, "test", n=cc.eval_size, path=cc.eval_data)
    for split, t in (("training", train), ("held-out", test)):
        if t is None or len(t) == 0:
            raise ValueError(f"task {cc.task!r} has no {split} problems")
    return train, test


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
    "budget": "what every method trains until it has spent: rollouts, tokens (prompt + generated) or seconds "
    "(wall clock of training; loading excluded)",
    "budget_value": "the budget (0: with rollouts, ES's iterations x population x prompts_per_iteration)",
    "methods": "methods to train, comma-separated: es, es_awd (ES with anchored weight decay), grpo, randopt",
    "anchor_decay": "es_awd: anchored weight decay lambda",
    "anchor_decay_norm": "es_awd: l2 or l1",
    "randopt_sigmas": "randopt: the sigma grid, comma-separated",
    "randopt_top_k": "randopt: the ensemble's size K (its members answer greedily, the vote decides)",
}
