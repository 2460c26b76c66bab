"""Earlier development versions of the run format: every upgrade rule, in one place.

A run directory written by an older espert still resumes and replays bit for bit.  What differs, and
where each difference is handled:

1. ``config.yaml``'s ``config`` (:func:`upgrade`, applied once by ``read_run_config``, so every reader of
   a run's config gets the upgraded mapping: ``Run.open``, resume, replay, ``espert eval``):

   a. a version-1 config (every field of :data:`V1_FIELDS`, none of :data:`LEGACY_DEFAULTS`) keeps the
      old behaviour of the fields whose default changed since (``prompt_sampler: python_random``, which
      ``espert.es.prompt_indices`` still implements);
   b. fields added later (:data:`RUN_ADDED_DEFAULTS`) get the behaviour of the runs written before them;
   c. a renamed key (``backend``, now ``evaluator``) is renamed by ``ESConfig.from_dict`` with a deprecation
      line (``config.renamed_keys``, the one rule for renamed keys, because hand-written config files use it too).

2. ``base_fingerprint`` without ``files`` (version 1: config.json and the weight files' names and
   sizes): ``check_base`` hands it to :func:`check_base_v1`.
3. log lines without a ``crc32`` (written before checksums): read as they are (:func:`unchecked_line`, from
   ``log._parse_line``).
4. a log without ``checkpoint`` records: the center checkpoint is loaded unverified, with a note
   (:func:`note_unverified_checkpoint`, from ``Run.load_checkpoint``).
5. a log without a ``task`` record, ``iter`` records without ``prompt_indices``: resume skips those
   checks (:func:`before_task_records`, :func:`before_prompt_logs`, from ``espert.trainer``).
6. what a killed setup of older espert versions left (:func:`abandoned_setup`): ``Run.open`` accepts the
   directory and ``Run.commit`` replaces it (:func:`clear_abandoned_setup`).
7. a config of a version-1 run (rule 1a) samples prompts with ``prompt_sampler: python_random``, which
   ``espert.es.prompt_indices`` keeps as a sampler (the ES layer sits below the run files, so the rule
   selects it here and the derivation stays there).
8. a log whose first line is not a ``config`` record (written before runs recorded their fixed settings
   there): ``config.yaml`` is read as it is, unverified, since there is nothing to check it against
   (``run.check_fixed_settings``); such a run resumes and replays as before.  Both sides of that check go
   through :func:`upgrade_config`, so a field added later compares by the behaviour it stands for.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from typing import Callable

from espert.files import BASE, CONFIG, LOG, WEIGHT_SUFFIXES, RunError

#: Every field of a version-1 run config (before ``evaluator`` and the fields below existed).
V1_FIELDS = frozenset(
    "model tiny_seed task train_data eval_data eval_split train_size eval_size backend device dtype chat_template "
    "max_new_tokens generation_batch_size cpu_threads vllm_engines vllm_tensor_parallel_size "
    "vllm_gpu_memory_utilization vllm_max_model_len quant quant_group_size include exclude iterations population "
    "antithetic sigma sigma_schedule sigma_end alpha alpha_schedule alpha_end normalization weight_decay "
    "prompts_per_iteration seed member_errors eval_every checkpoint_every".split()
)
#: Behaviour of version-1 runs for fields whose default changed since.
LEGACY_DEFAULTS = {"prompt_sampler": "python_random", "weight_decay_exclude": [], "reward_std_floor": 0.0}
#: Fields a run directory's config may lack because they came later, with the behaviour of the runs
#: written before them (their tiny base model was not pretrained).
RUN_ADDED_DEFAULTS = {"pretrain_steps": 0, "pretrain_reverse_share": 0.0, "quant_master": "float32"}


def v1_defaults(d: dict) -> dict:
    """Rule 1a: a version-1 config mapping with :data:`LEGACY_DEFAULTS` filled in (others unchanged)."""
    keys = {k.replace("-", "_") for k in d}
    if V1_FIELDS <= keys and not set(LEGACY_DEFAULTS) & keys:
        return {**LEGACY_DEFAULTS, **d}
    return d


def upgrade_config(d: dict) -> dict:
    """Rules 1a and 1b: a run directory's stored config mapping as today's ``ESConfig.from_dict`` reads it."""
    return {**RUN_ADDED_DEFAULTS, **v1_defaults(d)}


def upgrade(doc: dict) -> dict:
    """A parsed ``config.yaml`` of any earlier version, upgraded in place (and returned) to what today's
    code reads; the file itself is not rewritten."""
    doc["config"] = upgrade_config(doc["config"])
    return doc


def fingerprint_v1(ref: str) -> dict:
    """The fingerprint of runs made before version 2: config.json and the weight files' names and sizes."""
    h = hashlib.sha256()
    cfg = os.path.join(ref, "config.json")
    if os.path.exists(cfg):
        with open(cfg, "rb") as f:
            h.update(f.read())
    for f in sorted(os.listdir(ref)):
        if f.endswith(WEIGHT_SUFFIXES):
            h.update(f"{f}:{os.path.getsize(os.path.join(ref, f))}\n".encode())
    return {"sha256": h.hexdigest()}


def check_base_v1(path: str, want: dict, echo: Callable[[str], None] | None = None) -> None:
    """Rule 2: compare a version-1 fingerprint as far as it goes, and say that the weight contents cannot
    be verified."""
    if fingerprint_v1(path) != want:
        raise RunError(
            f"the base model at {path} is not the one this run started from: config.json or the "
            f"weight files' names or sizes differ. Replay and resume need the original base model"
        )
    if echo:
        echo(
            f"[espert] note: this run directory records only config.json and weight file sizes of its base "
            f"model (older espert), so the weight contents at {path} cannot be verified"
        )


def unchecked_line(crc: str | None) -> bool:
    """Rule 3: a log line without a ``crc32`` (written before checksums) is read as it is."""
    return crc is None


def before_task_records(task_record: dict | None) -> bool:
    """Rule 5: a log without a ``task`` record (older espert): resume cannot check the task."""
    return task_record is None


def before_prompt_logs(iteration_record: dict) -> bool:
    """Rule 5: an ``iter`` record without ``prompt_indices`` (older espert): resume cannot check its prompts."""
    return iteration_record.get("prompt_indices") is None


def note_unverified_checkpoint(path: str, echo) -> None:
    """Rule 4: a center checkpoint with no checksum in the log (written by an older espert) loads unverified."""
    echo(f"[espert] note: {path} has no checksum in {LOG} (older espert); loaded unverified")


def clear_abandoned_setup(final: str) -> None:
    """Rule 6: what a killed setup of an older espert left at a new run's place is replaced whole."""
    if os.path.isdir(final) and os.listdir(final):
        shutil.rmtree(final)


def abandoned_setup(run_dir: str) -> bool:
    """Rule 6: what a killed setup of older espert versions left: no config, an empty log, at most a base model."""
    names = set(os.listdir(run_dir))
    log = os.path.join(run_dir, LOG)
    return (
        CONFIG not in names
        and (not os.path.exists(log) or os.path.getsize(log) == 0)
        and all(n in (LOG, BASE) or n.startswith(f".{BASE}.tmp-") for n in names)
    )
