"""An engine's start says each of vLLM's repeated per-layer warnings once, counted (espert/vllm/patches/quiet.py).

vLLM logs "Attempted to load weight ... with dtype torch.float32 into parameter with dtype ..." once per weight,
"Failed to create oneDNN linear, fallback to torch linear" for the layers oneDNN refuses, and torch/vLLM
deprecation warnings.  A float16 engine of the tiny float32 model has all three where oneDNN has no float16
matmul (AVX-512 without FP16 or AMX, an AMD EPYC's); on a CPU with them (a Xeon with AMX) oneDNN packs
float16 too, so the engine runs with oneDNN's own ISA cap at AVX512_CORE_BF16.  Its start must print one
counted line per kind instead.  Errors pass in full.
About 25 s (one eager in-process engine in a fresh process).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

START = """
import os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
from espert.vllm import make_llm
llm = make_llm(sys.argv[1], dtype="float16", max_model_len=64)
llm.collective_rpc("es_setup")
print("STARTED", flush=True)
"""


def _engine_log(script: str, model: str, done: str, **env) -> list[str]:
    """The lines ``script`` (run on ``model`` in a fresh process) printed, once it printed ``done``."""
    env = dict(os.environ, PYTHONPATH=REPO, VLLM_LOGGING_LEVEL="WARNING", **env)  # as espert's commands set it
    env.pop("VLLM_DIST_IDENT", None)  # set by an earlier in-process engine of this worker; vLLM warns it is unknown
    p = subprocess.run([sys.executable, "-c", script, model], env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0 and done in p.stdout, p.stderr[-4000:]
    return (p.stdout + p.stderr).splitlines()  # vLLM logs to stdout


@pytest.fixture(scope="module")
def start_log(tiny_dir):
    # no float16 matmul in oneDNN, on any CPU: the fallback happens
    return _engine_log(START, tiny_dir, "STARTED", ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16")


def _lines(log, text):
    return [line for line in log if text in line]


def _raw_warnings(log):
    """vLLM's WARNING lines that reached the output as they are (espert's own lines say 'espert')."""
    return [line for line in log if " WARNING " in line and "espert" not in line]


def test_weights_loaded_into_another_dtype_are_one_line(start_log):
    assert not _lines(start_log, "Attempted to load weight"), "\n".join(start_log[-40:])
    said = _lines(start_log, "weights were loaded from torch.float32 into torch.float16 parameters")
    assert len(said) == 1, "\n".join(start_log[-40:])
    assert int(said[0].split("espert: ")[1].split()[0]) >= 2  # one per tensor the loader converted


def test_layers_on_torch_linear_are_one_line_with_the_reason(start_log):
    assert not _lines(start_log, "Failed to create oneDNN linear"), "\n".join(start_log[-40:])
    said = _lines(start_log, "layers use torch linear")
    assert len(said) == 1, "\n".join(start_log[-40:])
    assert "of 10 layers use torch linear" in said[0]  # 2 layers x (qkv, o, gate_up, down) + lm_head + embedding
    assert "could not create a primitive descriptor" in said[0]


#: vLLM-CPU's start-up warnings that every espert engine on this machine triggers by its set-up (eager mode, an
#: in-process engine, triton without a CPU backend, no LD_PRELOAD): counted into one line, never printed raw
EXPECTED_AT_START = (
    "Enforce eager set",
    "Inductor compilation was disabled",
    "Model Runner V2 requires Triton",
    "Triton is not installed",
    "doesn't include CPU backend",
    "is not found in LD_PRELOAD",
    "The global random seed is set",
)


def test_expected_start_up_warnings_are_one_line_that_explains_them(start_log):
    text = "\n".join(start_log[-60:])
    for raw in EXPECTED_AT_START:
        assert not _lines(start_log, raw), f"{raw!r} printed raw:\n{text}"
    said = _lines(start_log, "expected vLLM-CPU warnings")
    assert len(said) == 1, text
    assert int(said[0].split("espert: ")[1].split()[0]) >= 5
    assert "no CPU backend" in said[0] and "V1 model runner" in said[0]  # the two Triton lines, explained once
    assert not _raw_warnings(start_log), text


def test_errors_pass_in_full():
    """The filter drops only the warnings it counts: an error record with the same text goes through."""
    from espert.vllm.patches.quiet import Counter

    counter = Counter()
    warn = logging.LogRecord(
        "vllm.x",
        logging.WARNING,
        "f",
        1,
        "Attempted to load weight a with dtype torch.float32 into parameter with dtype torch.float16",
        (),
        None,
    )
    error = logging.LogRecord(
        "vllm.x",
        logging.ERROR,
        "f",
        1,
        "Attempted to load weight a with dtype torch.float32 into parameter with dtype torch.float16",
        (),
        None,
    )
    other = logging.LogRecord("vllm.x", logging.WARNING, "f", 1, "something else", (), None)
    assert counter.filter(warn) is False and counter.filter(error) is True and counter.filter(other) is True


BATCHED = """
import os, sys
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
from espert.tasks import load_task
from espert.vllm import VLLMEvaluator
task = load_task("copy", "train", n=4)
ev = VLLMEvaluator(sys.argv[1], task.score, noise="lowrank:4", members="batched", max_loras=2, max_new_tokens=2,
                   llm_kwargs={"max_model_len": 64, "multiprocess": False})
print("REWARDS", ev.evaluate([(1, 1), (1, -1)], 0.1, task.prompts, task.answers), flush=True)
ev.close()
"""


def test_batched_lora_members_add_no_raw_warning(tiny_dir):
    """vLLM warns at the first LoRA request that LoRAs with tokenizers of their own are deprecated; espert's
    members are noise on the base model's weights, with its tokenizer: counted with the expected warnings."""
    log = _engine_log(BATCHED, tiny_dir, "REWARDS")
    text = "\n".join(log[-40:])
    assert not _lines(log, "different tokenizers for different LoRAs"), text
    assert _lines(log, "LoRA members use the base model's tokenizer"), text
    assert not _raw_warnings(log), text
