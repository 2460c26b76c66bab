"""vLLM's compile cache is keyed by espert's version, commit and patch set (espert/vllm/patches/compile_key.py).

vLLM names its compile-cache directory after ``VllmConfig.compute_hash()`` (with its env and traced sources).
Each case computes that hash in a fresh process, as an engine's worker does after importing the worker
extension: two espert builds give two keys, one build gives one, and no espert build gives plain vLLM's.
About 15 s at load 2, over 2 min at load 10 (four processes importing vLLM); ESPERT_SLOW=1 adds two compiled
engine starts (~1.5 min).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HASH = """
import os, sys
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
if sys.argv[1] == "espert":
    from espert.vllm import patches
    patches.install()
from vllm.config import VllmConfig
print("HASH", VllmConfig().compute_hash())
"""


def _hash(tree: str, mode: str = "espert") -> str:
    env = dict(os.environ, PYTHONPATH=tree)
    p = subprocess.run(
        [sys.executable, "-c", HASH, mode], env=env, cwd=tree, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return next(line.split()[1] for line in p.stdout.splitlines() if line.startswith("HASH "))


def _copy(dst) -> str:
    shutil.copytree(
        os.path.join(REPO, "espert"), os.path.join(dst, "espert"), ignore=shutil.ignore_patterns("__pycache__")
    )
    return str(dst)


def test_two_espert_builds_give_two_keys(tmp_path):
    a, b = _copy(tmp_path / "a"), _copy(tmp_path / "b")
    prepack = os.path.join(b, "espert", "vllm", "patches", "cpu_prepack.py")
    with open(prepack) as f:
        src = f.read()
    bypassed = src.replace(
        "return torch.ops.espert.cpu_packed_linear(x, weight, bias)", "return self.run(x, weight, bias)"
    )
    assert bypassed != src
    with open(prepack, "w") as f:
        f.write(bypassed)  # the build the issue found sharing a cache directory with the working one
    key_a, key_a2, key_b = _hash(a), _hash(a), _hash(b)
    assert key_a == key_a2, "one build, one key"
    assert key_a != key_b, "two builds (one with the packed-linear op bypassed) shared a compile-cache key"
    assert _hash(REPO, "plain") not in (key_a, key_b), "an espert engine shares plain vLLM's compile cache"


def test_the_key_holds_version_commit_and_patch_set():
    from espert.vllm.patches import compile_key

    base = compile_key._key("0.1.0", "abc", ("cpu_prepack",))
    assert compile_key._key("0.1.1", "abc", ("cpu_prepack",)) != base
    assert compile_key._key("0.1.0", "abd", ("cpu_prepack",)) != base
    assert compile_key._key("0.1.0", "abc", ("cpu_prepack", "seeded")) != base
    assert compile_key._key("0.1.0", "abc", ("cpu_prepack",)) == base


START = """
import os, sys, time
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
model, mode = sys.argv[1], sys.argv[2]
if mode == "espert":
    from espert.vllm import make_llm
    llm = make_llm(model, dtype="bfloat16", max_model_len=64, enforce_eager=False)
    llm.collective_rpc("es_setup")
else:
    from vllm import LLM
    llm = LLM(model=model, dtype="bfloat16", max_model_len=64, enforce_eager=False, enable_prefix_caching=False)
print("STARTED")
"""


@pytest.mark.skipif(os.environ.get("ESPERT_SLOW") != "1", reason="two compiled engine starts: ESPERT_SLOW=1")
def test_compiled_engines_write_apart(tiny_dir, tmp_path):
    """A compiled espert engine and a compiled plain vLLM engine of one model, one cache root: two directories."""
    env = dict(os.environ, PYTHONPATH=REPO, VLLM_CACHE_ROOT=str(tmp_path / "cache"))
    for mode in ("plain", "espert"):
        p = subprocess.run(
            [sys.executable, "-c", START, tiny_dir, mode], env=env, capture_output=True, text=True, timeout=900
        )
        assert p.returncode == 0 and "STARTED" in p.stdout, p.stderr[-3000:]
    dirs = os.listdir(tmp_path / "cache" / "torch_compile_cache" / "torch_aot_compile")
    assert len(dirs) == 2, dirs
