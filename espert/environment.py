"""What this installation of espert is and can do: ``espert env``, bug reports and every run's config.yaml.

:func:`describe` collects the facts (version and commit, the compiled kernels, the packages beside
them, which extras are present); :func:`format_environment` prints them as one screen.  Nothing here
imports vLLM, transformers or Triton: versions come from the installed distributions' metadata.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
import sys

from espert import __version__
from espert.extras import EXTRAS, present, version

#: distributions whose versions decide results or speed, in the order they are printed
PACKAGES = ("torch", "triton", "numpy", "transformers", "tokenizers", "vllm", "math-verify", "trl", "matplotlib")


def git_commit() -> str:
    """The commit espert runs from: the checkout's own (with ``+dirty``) for a source or editable
    install, else the one recorded when the wheel was built (``espert/_build.py``), else "unknown"."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    if os.path.exists(os.path.join(root, ".git")):
        try:
            git = lambda *a: subprocess.run(  # noqa: E731
                ["git", *a], cwd=root, capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
            return git("rev-parse", "--short=12", "HEAD") + ("+dirty" if git("status", "--porcelain", "-uno") else "")
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        from espert._build import GIT_COMMIT

        return GIT_COMMIT
    except ImportError:
        return "unknown"


def kernels() -> dict:
    """The compiled module's facts: ``{"compiled", "error", "cpu_isa", "cuda_archs", "gpu_ops"}``.

    gpu_ops: the backend espert's ops use on a CUDA tensor here (``cuda``: the compiled kernels;
    ``triton``: the JIT fallback, no compiler needed; None: neither is available).
    """
    try:
        from espert import _C
    except ImportError as e:
        return {
            "compiled": False,
            "error": f"{type(e).__name__}: {e}",
            "cpu_isa": None,
            "cuda_archs": [],
            "gpu_ops": None,
        }
    archs = [a for a in str(getattr(_C, "cuda_archs", "")).split(",") if a]
    gpu_ops = "cuda" if _C.has_cuda else ("triton" if version("triton") else None)
    return {"compiled": True, "error": None, "cpu_isa": _C.cpu_isa(), "cuda_archs": archs, "gpu_ops": gpu_ops}


def gpus() -> list[str]:
    """Names of the CUDA devices torch sees (empty without one, or without a CUDA build of torch)."""
    try:
        import torch

        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - no driver, a CPU build: no GPUs
        return []


def jail_facts() -> dict:
    """Whether code rewards can run jailed here (espert.tasks.jail; probed once per process)."""
    from espert.tasks import jail

    return dataclasses.asdict(jail.status())


def describe(with_gpus: bool = True) -> dict:
    """Every fact of ``espert env`` as a JSON-able dict (what config.yaml records under ``environment``)."""
    facts = {
        "espert": __version__,
        "commit": git_commit(),
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "kernels": kernels(),
        "packages": {name: version(name) for name in PACKAGES},
        "extras": present(),
        "jail": jail_facts(),
    }
    if with_gpus:
        facts["gpus"] = gpus()
    return facts


def format_environment(facts: dict) -> str:
    """:func:`describe`'s facts as the screen ``espert env`` prints."""
    k = facts["kernels"]
    isa = {"avx512": "AVX-512", "avx2": "AVX2", "generic": "generic (no AVX2)"}
    if k["compiled"]:
        cpu = f"{isa.get(k['cpu_isa'], k['cpu_isa'])} path"
        cuda = (
            f"compiled for sm_{', sm_'.join(k['cuda_archs'])}" if k["cuda_archs"] else "not compiled (no nvcc at build)"
        )
    else:
        cpu = cuda = f"espert._C does not import ({k['error']})"
    gpu_ops = {
        "cuda": "the compiled CUDA kernels",
        "triton": "the Triton kernels (JIT, no compiler needed)",
        None: "none: install triton, or build with nvcc",
    }[k["gpu_ops"]]
    gpus = facts.get("gpus")
    lines = [
        f"espert {facts['espert']} (commit {facts['commit']})",
        f"python {facts['python']} on {facts['platform']}",
        "kernels:",
        f"  cpu     {cpu}",
        f"  cuda    {cuda}",
        f"  triton  {facts['packages'].get('triton') or 'not installed'}",
        f"  ops on a CUDA tensor use {gpu_ops}",
    ]
    if gpus is not None:
        lines.append(f"  gpus    {', '.join(gpus) if gpus else 'none visible'}")
    lines.append("packages:")
    lines += [f"  {name:<13}{v or '-'}" for name, v in facts["packages"].items()]
    extras = sorted(set(e for e, _ in EXTRAS.values()))
    lines.append("extras:  " + "  ".join(f"{e} {'yes' if facts['extras'][e] else 'no'}" for e in extras))
    missing = [e for e in extras if not facts["extras"][e]]
    if missing:
        lines.append(f"         (pip install 'espert[{','.join(missing)}]' adds the missing ones)")
    jail = facts.get("jail")
    if jail is not None:
        if jail["available"]:
            lines.append(f"jail:    {jail['tool']} ({jail['how']})")
        else:
            lines.append(f"jail:    unavailable: {jail['reason']}; code rewards need --unsafe-code-reward")
    return "\n".join(lines)


def main() -> int:
    """``espert env``: print :func:`format_environment`."""
    print(format_environment(describe()))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
