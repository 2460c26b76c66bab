"""A run directory opened for training: creation (atomic), resume checks, the log, checkpoints and restore.

A new run directory is built under a temporary sibling name and renamed into place once the model,
tokenizer, task and evaluator have loaded (:meth:`Run.commit`), so it either holds a complete setup
or does not exist, and a failed start leaves nothing that blocks the retry.  Each log line is written whole, flushed and fsynced
*before* its update is applied.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from typing import Callable, Mapping

import torch
import yaml

from espert.config import ESConfig
from espert.es import apply_record
from espert.files import (
    BASE,
    CENTER,
    CONFIG,
    EXPORT,
    FORMAT,
    LOG,
    RunError,
    atomic_write_text,
    check_output_path,
    fsync_dir,
    kill_point,
    lock_run,
    naming,
    read_config_file,
    stat_key,
    unlock_run,
)
from espert.runs.checkpoint import load_center, save_center
from espert.runs.export import base_identity, export_iteration, export_model, resolve_model_dir
from espert.runs.fingerprint import base_fingerprint, check_base
from espert.runs.gguf import gguf_path, is_gguf
from espert.runs.legacy import (
    abandoned_setup,
    clear_abandoned_setup,
    note_unverified_checkpoint,
    upgrade,
    upgrade_config,
)
from espert.runs.log import checkpoint_hashes, first_record, iteration_records, log_line, read_log
from espert.tensorfile import FileChunks

#: ESConfig fields that may change when a run is resumed (they do not change any weight or reward).
RESUMABLE_CHANGES = (
    "iterations",
    "eval_every",
    "checkpoint_every",
    "device",
    "restore",
    "export_dtype",
    "trackers",
    "tracker_project",
    "unsafe_code_reward",
    "vllm_engines",
    "vllm_engines_file",
    "vllm_deadline_floor",
)


def check_device(device: str) -> None:
    """Raise ValueError unless torch can place tensors on ``device`` here."""
    try:
        d = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"device {device!r} is not a torch device: {e}") from None
    if d.type == "cpu":
        return
    if d.type == "cuda":  # without creating a CUDA context (vLLM workers must fork before one exists)
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            why = "this torch was built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"device {device!r} is not available: {why}; use --device cpu")
        if (d.index or 0) >= n:
            raise ValueError(f"device {device!r} is not available: {n} CUDA GPU(s) visible")
        return
    try:
        torch.empty(0, device=d)
    except Exception as e:  # noqa: BLE001 - each backend raises its own type
        raise ValueError(f"device {device!r} is not available here: {str(e).splitlines()[0]}") from None


def model_ref(cfg: ESConfig) -> str:
    """What ``config.yaml`` records as ``base_model``: ``base_model`` (tiny), an absolute directory or GGUF
    file (``gguf_file``, a named model: the file), or a Hub id."""
    if cfg.model == "tiny":
        return BASE
    gguf = gguf_path(cfg.model, cfg.gguf_file)
    if gguf is not None:
        return gguf
    return os.path.abspath(cfg.model) if os.path.isdir(cfg.model) else cfg.model


def check_inputs(cfg: ESConfig, ref: str) -> None:
    """Everything a run needs that can be checked before its directory is written: the device, the data
    files, the base model ``ref`` (as :func:`model_ref` gives it; resolved now: a Hub id is downloaded,
    or fails fast)."""
    from espert.tasks.loaders import HUB_PATH

    check_device(cfg.device)
    for name in ("train_data", "eval_data"):
        p = getattr(cfg, name)
        if p is not None and p != HUB_PATH and not os.path.exists(p):
            raise FileNotFoundError(f"{name} not found: {p}")
    if ref != BASE:
        resolve_model_dir(ref, print)


def build_tiny_base(path: str, cfg: ESConfig) -> None:
    """The tiny base model of a run with ``model: tiny``, written to ``path``: random init from
    ``tiny_seed``, then ``pretrain_steps`` of pretraining on the copy/reverse mixture (deterministic)."""
    from espert.tiny import build_tiny_model, tiny_spec

    try:
        build_tiny_model(
            path,
            seed=cfg.tiny_seed,
            spec=tiny_spec(cfg.tiny_hidden_size),
            pretrain_steps=cfg.pretrain_steps,
            reverse_share=cfg.pretrain_reverse_share,
        )
    except Exception as e:  # noqa: BLE001 - safetensors' Rust writer reports a full disk as SafetensorError
        m = re.search(r"\(os error (\d+)\)", str(e))
        if isinstance(e, OSError) or m is None:
            raise
        raise OSError(int(m.group(1)), os.strerror(int(m.group(1))), os.path.join(path, "model.safetensors")) from e


def read_run_config(run_dir: str) -> dict:
    """The parsed ``config.yaml`` of a run directory (clear errors when it is not one), its fixed settings
    verified against the log (:func:`check_fixed_settings`)."""
    path = os.path.join(run_dir, CONFIG)
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{run_dir} is not an espert run directory (no {CONFIG})")
    doc = read_config_file(path)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("config"), dict):
        raise RunError(f"{path}: not an espert run config (format {FORMAT})")
    check_fixed_settings(run_dir, doc["config"])
    return upgrade(doc)  # earlier versions of the format: espert.runs.legacy


def fixed_settings(config: dict) -> dict:
    """The settings of a run's config a resume may not change: all but :data:`RESUMABLE_CHANGES`, and
    ``iterations`` too when a schedule depends on it (what :func:`resume_changes` enforces)."""
    scheduled = any(config.get(f"{k}_schedule", "constant") != "constant" for k in ("sigma", "alpha"))
    return {k: v for k, v in config.items() if k not in RESUMABLE_CHANGES or (k == "iterations" and scheduled)}


def config_record(config: dict) -> dict:
    """The first record of a new run's log: its fixed settings, which ``config.yaml`` is checked against
    whenever it is read, as each log line is by its crc32."""
    return {"kind": "config", "fixed": fixed_settings(config)}


def check_fixed_settings(run_dir: str, config: dict) -> None:
    """RunError naming every fixed setting that ``RUN/config.yaml`` holds with another value than the log's
    config record (a hand edit), with the two ways on.  A log without that record (older espert) has
    nothing to check against: legacy rule 8."""
    rec = first_record(os.path.join(run_dir, LOG))
    if rec is None or rec.get("kind") != "config":
        return
    logged, have, missing = upgrade_config(rec["fixed"]), upgrade_config(config), object()
    changed = {k: (v, have.get(k, missing)) for k, v in logged.items() if have.get(k, missing) != v}
    if changed:
        path = os.path.join(run_dir, CONFIG)
        said = "; ".join(
            f"{k}: the run has {a!r}, the file {'nothing' if b is missing else repr(b)}"
            for k, (a, b) in changed.items()
        )
        raise RunError(
            f"{path} was edited after the run wrote it ({said}), and these settings are fixed for the life of a run "
            f"(its log records them). Put them back to continue it (espert train --run-dir {run_dir} --resume), or "
            f"start a new run from the edited file: espert train --config {path} --run-dir NEW_DIR"
        )


def _holds_run(run_dir: str) -> bool:
    return any(os.path.exists(os.path.join(run_dir, n)) for n in (CONFIG, LOG, CENTER, EXPORT))


def _remove_stale_setups(parent: str, name: str) -> None:
    """Remove temporary siblings of ``name`` left by setups whose process is gone."""
    for n in os.listdir(parent):
        m = re.fullmatch(rf"\.{re.escape(name)}\.tmp-(\d+)", n)
        if m:
            try:
                os.kill(int(m.group(1)), 0)
            except ProcessLookupError:
                shutil.rmtree(os.path.join(parent, n), ignore_errors=True)
            except OSError:
                pass


def resume_changes(stored: ESConfig, cfg: ESConfig, run_dir: str) -> dict[str, tuple]:
    """``{field: (stored, given)}`` of what a resume changes; ValueError listing every change that is not
    resumable (:data:`RESUMABLE_CHANGES`; ``iterations`` only with constant schedules)."""
    diff = {k: (getattr(stored, k), getattr(cfg, k)) for k in stored.to_dict() if getattr(stored, k) != getattr(cfg, k)}
    bad = {k: v for k, v in diff.items() if k not in RESUMABLE_CHANGES}
    if "iterations" in diff and (cfg.sigma_schedule != "constant" or cfg.alpha_schedule != "constant"):
        bad["iterations"] = diff["iterations"]
    if bad:
        lines = "; ".join(f"{k}: run has {a!r}, given {b!r}" for k, (a, b) in sorted(bad.items()))
        raise ValueError(
            f"config mismatch on resume of {run_dir}: {lines}. Resume with the run's own "
            f"config (only {', '.join(RESUMABLE_CHANGES)} may change; iterations only with "
            f"constant schedules), or start a new run directory."
        )
    return diff


def _refuse_occupied(run_dir: str) -> None:
    """FileExistsError unless ``run_dir`` is free for a new run: missing, empty, or what a killed setup of an
    older espert left (:func:`espert.runs.legacy.abandoned_setup`)."""
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise FileExistsError(f"{run_dir} exists and is not a directory")
    check_output_path(run_dir, "run directory", spare=24)  # room for its setup's sibling .NAME.tmp-PID
    if not os.path.isdir(run_dir) or abandoned_setup(run_dir):
        return
    if _holds_run(run_dir):
        raise FileExistsError(
            f"{run_dir} already holds an espert run; pass --resume to continue it, or choose another --run-dir"
        )
    if os.listdir(run_dir):
        raise FileExistsError(f"{run_dir} is not empty and holds no espert run; choose another --run-dir")


def _new_doc(cfg: ESConfig, ref: str) -> dict:
    """A new run's config.yaml document (its base fingerprint is filled in once the base is in place)."""
    from espert import __version__
    from espert.environment import describe

    return {
        "format": FORMAT,
        "espert_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "base_model": ref,
        "base_fingerprint": None,
        "task": cfg.task,
        "config": cfg.to_dict(),
        "environment": describe(),  # what `espert env` prints: commit, kernels, package versions
    }


class Run:
    """A run directory opened for training (new or resumed)."""

    def __init__(
        self,
        path: str,
        cfg: ESConfig,
        doc: dict,
        echo: Callable[[str], None] | None = print,
        *,
        final: str | None = None,
        lock: tuple[int, str] | None = None,
    ):
        """``path``: the run directory; for a new run the temporary sibling it is built in, ``final`` the
        name :meth:`commit` renames it to, ``lock`` the writer lock :meth:`open` already took for it."""
        self.path, self.cfg, self.doc, self._final = path, cfg, doc, final
        self.echo = echo or (lambda s: None)
        self._lock = lock or lock_run(path)  # before anything is read for writing: one writer per run
        try:
            self.records = read_log(self.file(LOG), repair=True)
            self._cleanup()
            self._log = open(self.file(LOG), "ab", buffering=0)  # unbuffered: a failed write is undone below
        except BaseException:
            if lock is None:  # a lock handed in is released by whoever took it
                unlock_run(self._lock)
            raise
        self._verified: tuple[str, int | None] | None = None  # (stat key, iteration) of the checked center
        self._base_path: str | None = None

    def _cleanup(self) -> None:
        """Remove what a killed process left half-written (temporary files and directories)."""
        if not os.path.isdir(self.path):
            return
        names = os.listdir(self.path)
        if EXPORT not in names:  # killed between the two renames of an export swap: keep the old one
            olds = sorted(n for n in names if n.startswith(f"{EXPORT}.old-"))
            if olds:
                os.replace(self.file(olds[-1]), self.file(EXPORT))
        for n in os.listdir(self.path):
            if ".tmp-" in n or n.startswith(f"{EXPORT}.old-"):
                p = self.file(n)
                shutil.rmtree(p) if os.path.isdir(p) else os.unlink(p)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def base_path(self) -> str:
        """The local directory of the base model: the run's own ``base_model/`` (tiny), a local directory, or
        the Hub snapshot of a Hub id (resolved once)."""
        if self._base_path is None:
            ref = self.doc["base_model"]
            self._base_path = self.file(ref) if ref == BASE else resolve_model_dir(ref)
        return self._base_path

    # -- opening --
    @classmethod
    def open(
        cls, run_dir: str, cfg: ESConfig | None, resume: bool = False, echo: Callable[[str], None] | None = print
    ) -> "Run":
        """Create a new run in ``run_dir`` or (``resume``) reopen it.

        Every input is checked (:func:`check_inputs`) before anything is written.  A new run
        refuses a directory that already holds a run, and is built under a temporary sibling name
        that :meth:`commit` renames into place once the caller has loaded everything (a kill or a
        failed start leaves nothing; :meth:`close` removes an uncommitted one).  On resume,
        ``cfg`` must equal the stored config except for :data:`RESUMABLE_CHANGES` (``iterations``
        only with constant schedules); anything else raises ValueError listing the differences.
        """
        if resume:
            return cls._reopen(run_dir, cfg, echo)
        if cfg is None:
            raise ValueError("a new run needs a config (cfg=None is only for resuming)")
        _refuse_occupied(run_dir)
        return cls._create(run_dir, cfg, echo)

    @classmethod
    def _reopen(cls, run_dir: str, cfg: ESConfig | None, echo) -> "Run":
        doc = read_run_config(run_dir)
        stored = ESConfig.from_dict(doc["config"])
        cfg = cfg or stored
        diff = resume_changes(stored, cfg, run_dir)
        if is_gguf(doc["base_model"]):  # the file's sha256 before its (cached) conversion is looked up
            check_base(doc["base_model"], doc.get("base_fingerprint"), echo)
        check_inputs(cfg, doc["base_model"])
        run = cls(run_dir, cfg, doc, echo)
        try:
            run._ensure_base()
            if diff:
                run.doc["config"] = cfg.to_dict()
                run._write_config()
                run.echo(f"[espert] resume: changed {', '.join(f'{k}={b!r}' for k, (_, b) in diff.items())}")
        except BaseException:
            run.close()  # the writer lock too
            raise
        return run

    @classmethod
    def _create(cls, run_dir: str, cfg: ESConfig, echo) -> "Run":
        """A new run, built in a temporary sibling directory under the writer lock (see :meth:`open`)."""
        ref = model_ref(cfg)
        check_inputs(cfg, ref)
        doc = _new_doc(cfg, ref)
        parent, name = os.path.split(os.path.abspath(run_dir))
        os.makedirs(parent, exist_ok=True)
        lock = lock_run(run_dir)  # held from setup to close: a second start of the same run is refused
        tmp = os.path.join(parent, f".{name}.tmp-{os.getpid()}")
        try:
            _refuse_occupied(run_dir)  # written between the check in open and the lock
            _remove_stale_setups(parent, name)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            if ref == BASE:
                build_tiny_base(os.path.join(tmp, BASE), cfg)
                kill_point("setup-base")
            doc["base_fingerprint"] = base_fingerprint(os.path.join(tmp, BASE) if ref == BASE else base_identity(ref))
            atomic_write_text(os.path.join(tmp, CONFIG), _dump_config(doc))
            atomic_write_text(os.path.join(tmp, LOG), log_line(config_record(doc["config"])).decode())
            return cls(tmp, cfg, doc, echo, final=run_dir, lock=lock)
        except BaseException as e:
            if isinstance(e, OSError) and str(e.filename).startswith(tmp):  # named as the user knows it
                e.filename = run_dir + str(e.filename)[len(tmp) :]
            shutil.rmtree(tmp, ignore_errors=True)
            unlock_run(lock)
            raise

    def commit(self) -> None:
        """Rename a new run's directory into place, once everything it needs has loaded (model, tokenizer,
        task, evaluator): a start that fails before leaves nothing behind, so the same command can be
        retried.  A no-op for a resumed (or already committed) run."""
        if self._final is None:
            return
        os.fsync(self._log.fileno())
        fsync_dir(self.path)
        kill_point("setup-done")
        clear_abandoned_setup(self._final)
        os.replace(self.path, self._final)  # also onto an empty directory: a single atomic rename
        fsync_dir(os.path.dirname(os.path.abspath(self._final)))
        self.path, self._final, self._base_path = self._final, None, None

    def _write_config(self) -> None:
        atomic_write_text(self.file(CONFIG), _dump_config(self.doc))

    def _ensure_base(self) -> None:
        """Build the tiny base model if the run uses one and it is missing (deterministic in tiny_seed);
        check the base model against the stored fingerprint."""
        if self.doc["base_model"] == BASE and not os.path.exists(os.path.join(self.base_path, "config.json")):
            tmp = self.file(f".{BASE}.tmp-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            build_tiny_base(tmp, self.cfg)
            shutil.rmtree(self.base_path, ignore_errors=True)
            os.replace(tmp, self.base_path)
            fsync_dir(self.path)
        ref = self.doc["base_model"]
        check_base(self.base_path if ref == BASE else base_identity(ref), self.doc.get("base_fingerprint"), self.echo)

    # -- log --
    def append(self, rec: dict) -> None:
        """Append one record as a whole line (with its crc32), fsynced.  A write the disk refuses is cut
        off again (the log ends at its last whole line, as before) and raised naming the log."""
        line, fd = memoryview(log_line(rec)), self._log.fileno()
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            with naming(os.path.join(self._final or self.path, LOG)):  # the name the user knows
                done = 0
                while done < len(line):
                    done += os.write(fd, line[done:])
                os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise
        self.records.append(rec)
        kill_point(f"logged-{rec.get('kind')}", rec.get("iteration"))

    def iterations(self) -> list[dict]:
        return iteration_records(self.records, self.file(LOG))

    def last_iteration(self) -> int:
        its = self.iterations()
        return its[-1]["iteration"] if its else 0

    def last_eval(self) -> dict | None:
        evals = [r for r in self.records if r.get("kind") == "eval"]
        return evals[-1] if evals else None

    # -- state --
    def load_checkpoint(self, lazy: bool = False) -> tuple[Mapping[str, torch.Tensor], int]:
        """The verified center checkpoint (see :func:`load_center`); FileNotFoundError or RunError otherwise."""
        path = self.file(CENTER)
        known = checkpoint_hashes(self.records)
        state, it = load_center(path, known, lazy)
        if not known:
            note_unverified_checkpoint(path, self.echo)
        self._verified = (stat_key(os.stat(path)), it)
        return state, it

    def checkpoint_iteration(self) -> int | None:
        """The iteration of the complete checkpoint on disk: a verified center and an export of the same
        iteration; None when there is none (missing, damaged, or the export is behind)."""
        path = self.file(CENTER)
        if not os.path.exists(path):
            return None
        key = stat_key(os.stat(path))
        if self._verified is None or self._verified[0] != key:
            try:
                _, it = load_center(path, checkpoint_hashes(self.records), lazy=True)
            except (RunError, OSError):
                it = None
            self._verified = (key, it)
        it = self._verified[1]
        return it if it is not None and export_iteration(self.file(EXPORT)) == it else None

    def restore(self, evaluator) -> int:
        """Bring the evaluator's center to the last logged iteration: checkpoint, then replay the log tail.

        A damaged checkpoint is reported (naming the file and the problem) and the center rebuilt from
        the base model and the whole log, then checkpointed again.
        """
        its = self.iterations()
        last = its[-1]["iteration"] if its else 0
        start, rebuilt = 0, False
        if os.path.exists(self.file(CENTER)):
            try:
                state, start = self.load_checkpoint(lazy=True)  # read tensor by tensor by the evaluator
            except RunError as e:
                self.echo(f"[espert] warning: {e}; rebuilding the center from the base model and {LOG}")
                rebuilt = True
            else:
                if start > last:
                    raise RunError(
                        f"{self.file(CENTER)} is at iteration {start} but {self.file(LOG)} ends at "
                        f"iteration {last}: log records are missing, so the run cannot continue"
                    )
                evaluator.load_center(state)
        for rec in its[start:]:
            apply_record(evaluator, rec)
        if rebuilt:
            self.checkpoint(evaluator, last)
        if last:
            self.echo(f"[espert] resumed at iteration {last} (checkpoint {start} + {last - start} replayed updates)")
        return last

    def checkpoint(self, evaluator, t: int) -> None:
        """Save the center at iteration t (its sha256 logged first) and export it in the base model's format.

        When the evaluator offers a chunk source (``center_stream()``, e.g. vLLM) the center file is
        written from it and the export from that file, chunk by chunk: the workers are pulled once and
        the driver never holds the whole center; else from ``center_state()`` and ``export_state()``.
        Both routes give the same bytes."""

        def log_checksum(sha: str) -> None:  # write-ahead: a checkpoint file on disk is always one the log knows
            if checkpoint_hashes(self.records).get(sha) != t:
                self.append({"kind": "checkpoint", "iteration": t, "file": CENTER, "sha256": sha})
            kill_point("checkpoint-logged", t)

        stream = evaluator.center_stream()
        state = evaluator.center_state() if stream is None else stream
        save_center(self.file(CENTER), state, t, before_replace=log_checksum)
        del state  # (full-dict route) not held while the export is written
        self._verified = (stat_key(os.stat(self.file(CENTER))), t)
        export_model(  # streamed: from the center file just written (the workers are pulled once)
            evaluator.export_state() if stream is None else FileChunks(self.file(CENTER), stream.chunk_bytes),
            self.base_path,
            self.file(EXPORT),
            iteration=t,
            note={"run": os.path.abspath(self.path)},
            dtype=self.cfg.export_dtype,
        )

    def summary(self) -> dict:
        evals = [r for r in self.records if r.get("kind") == "eval"]
        its = self.iterations()
        return {
            "run_dir": self.path,
            "iterations": len(its),
            "heldout": [(r["iteration"], r["mean"]) for r in evals],
            "train_reward": [(r["iteration"], r["reward"]["mean"]) for r in its],
            "export": self.file(EXPORT) if os.path.isdir(self.file(EXPORT)) else None,
        }

    def close(self) -> None:
        """Close the log and release the writer lock; a new run never committed is removed."""
        self._log.close()
        if self._final is not None:
            shutil.rmtree(self.path, ignore_errors=True)
        unlock_run(self._lock)


def intact_state(run_dir: str) -> str:
    """What ``run_dir`` holds intact, in words: the line that reports a failed write ends with it
    ("the run directory is as before this write (log.jsonl: iteration 7; last good checkpoint: iteration 6)")."""
    log, ck = os.path.join(run_dir, LOG), os.path.join(run_dir, CENTER)
    if not os.path.exists(os.path.join(run_dir, CONFIG)):
        return "nothing was written (the run directory was never created)"
    try:
        records = read_log(log)
        last = len(iteration_records(records, log))
    except (RunError, OSError) as e:
        return f"the run directory could not be read back: {e}"
    it = None
    if os.path.exists(ck):
        try:
            it = load_center(ck, checkpoint_hashes(records), lazy=True)[1]
        except (RunError, OSError):
            pass
    parts = [f"{LOG}: iteration {last}", "no checkpoint yet" if it is None else f"last good checkpoint: iteration {it}"]
    ex = export_iteration(os.path.join(run_dir, EXPORT))
    if ex is not None and ex != it:
        parts.append(f"{EXPORT}/: iteration {ex}")
    return f"the run directory is as before this write ({'; '.join(parts)})"


def _dump_config(doc: dict) -> str:
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=None)
