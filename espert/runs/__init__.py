"""Run directories: config, write-ahead log, center checkpoints, HF-format export and replay.

A run directory holds everything needed to resume a run or rebuild its weights::

    RUN/config.yaml          format, espert version, base model reference + content fingerprint, the full ESConfig
    RUN/base_model/          the tiny model, when the run generated it (model: tiny)
    RUN/log.jsonl            append-only; one JSON object per line, each with a "crc32" of the rest of the line:
                               {"kind": "iter", "iteration": t, "seeds": [...], "coeffs": [...], "decay": d,
                                "members": [[seed, sign], ...], "rewards": [...], "reward": {mean,max,min,std,n_valid},
                                "sigma", "alpha", "prompt_indices", "skipped", "time", "eval_seconds"}
                               {"kind": "eval", "iteration": t, "mean": m, "n": n, "time": ...}  (held-out, center θ_t)
                               {"kind": "checkpoint", "iteration": t, "file": "center.safetensors", "sha256": h}
                               {"kind": "resume", "iteration": t, "time": ...}  (a resumed process went on from t)
    RUN/center.safetensors   float32 center θ_k by logical name; metadata {"iteration": k}
    RUN/export/              θ_k in the base model's own format (config, tokenizer, *.safetensors with HF names)

Write rules: a new run directory is built under a temporary sibling name and renamed into place,
so it either holds a complete setup or does not exist.  Every file is written to a temporary
name, fsynced and ``os.replace``d (the export directory is swapped in as a whole); each log line
is written whole, flushed and fsynced *before* its update is applied, and a checkpoint's sha256
is logged before the file replaces the previous one.  Safetensors files are written by
:mod:`espert.tensorfile` (sorted header keys), so identical runs give byte-identical files, whether the
center came as a dict or streamed in chunks (an evaluator's ``center_stream()``: vLLM).

On open, a torn last log line (no newline: the process died mid-write) is dropped and the file
truncated to the last complete line; any other damage (bad JSON, a checksum mismatch, also on a
complete last line) is an error naming the file and line.  A center checkpoint is used only if
its sha256 is one the log recorded; a damaged one is named and the center rebuilt from the log.

Resume: θ = base model → load ``center.safetensors`` (iteration k) → apply the logged updates
k+1..last → finish what a kill cut off at ``last`` (its held-out evaluation, its checkpoint) →
continue at last+1.  Replay: θ = base model → apply every logged update.  Updates run on the
float32 host master through the CPU op, so both are bit-identical to the original run.

Tests kill a run at named points (:func:`kill_point`) through the environment variable
``ESPERT_TEST_KILL_AT=POINT[:ITERATION]``.
"""

from espert.files import (
    BASE,
    CENTER,
    CONFIG,
    EXPORT,
    FORMAT,
    KILL_ENV,
    LOG,
    MODEL_SUFFIXES,
    WEIGHT_SUFFIXES,
    RunBusy,
    RunError,
    atomic_write,
    atomic_write_text,
    fsync_dir,
    is_write_error,
    kill_point,
    lock_path,
    read_config_file,
    sha256_file,
    write_error_line,
)
from espert.runs import legacy  # noqa: F401 - the upgrade rules of earlier run formats
from espert.runs.checkpoint import CenterFile, load_center, save_center
from espert.runs.export import export_iteration, export_model, is_hub_id, resolve_model_dir
from espert.runs.fingerprint import base_fingerprint, check_base
from espert.runs.log import checkpoint_hashes, iteration_records, log_line, read_log
from espert.runs.replay import replay
from espert.runs.run import (
    RESUMABLE_CHANGES,
    Run,
    _dump_config,  # noqa: F401 - tests rewrite config.yaml with it
    build_tiny_base,
    check_device,
    check_inputs,
    intact_state,
    model_ref,
    read_run_config,
)
from espert.tensorfile import write_safetensors  # re-exported: run files are written with it

__all__ = [
    "BASE",
    "RunBusy",
    "lock_path",
    "CENTER",
    "CONFIG",
    "EXPORT",
    "FORMAT",
    "KILL_ENV",
    "LOG",
    "MODEL_SUFFIXES",
    "RESUMABLE_CHANGES",
    "WEIGHT_SUFFIXES",
    "CenterFile",
    "Run",
    "RunError",
    "atomic_write",
    "atomic_write_text",
    "base_fingerprint",
    "build_tiny_base",
    "check_base",
    "check_device",
    "check_inputs",
    "checkpoint_hashes",
    "export_iteration",
    "export_model",
    "fsync_dir",
    "is_hub_id",
    "is_write_error",
    "intact_state",
    "iteration_records",
    "kill_point",
    "load_center",
    "log_line",
    "model_ref",
    "read_config_file",
    "read_log",
    "read_run_config",
    "replay",
    "resolve_model_dir",
    "save_center",
    "sha256_file",
    "write_error_line",
    "write_safetensors",
]
