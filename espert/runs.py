"""Run directories: config, write-ahead log, center checkpoints, HF-format export and replay.

A run directory holds everything needed to resume a run or rebuild its weights::

    RUN/config.yaml          format, espert version, base model reference + fingerprint, the full ESConfig
    RUN/base_model/          the tiny model, when the run generated it (model: tiny)
    RUN/log.jsonl            append-only; one JSON object per line:
                               {"kind": "iter", "iteration": t, "seeds": [...], "coeffs": [...], "decay": d,
                                "members": [[seed, sign], ...], "rewards": [...], "reward": {mean,max,min,std,n_valid},
                                "sigma", "alpha", "prompt_indices", "skipped", "time", "eval_seconds"}
                               {"kind": "eval", "iteration": t, "mean": m, "n": n, "time": ...}  (held-out, center θ_t)
    RUN/center.safetensors   float32 center θ_k by logical name; metadata {"iteration": k}
    RUN/export/              θ_k in the base model's own format (config, tokenizer, *.safetensors with HF names)

Write rules: every file is written to a temporary name, fsynced and ``os.replace``d (the export
directory is swapped in as a whole); each log line is written whole, flushed and fsynced *before*
its update is applied.  On open, a torn last log line (no newline or bad JSON: the process died
mid-write) is dropped and the file truncated to the last complete line; any other damage is an error.

Resume: θ = base model → load ``center.safetensors`` (iteration k) → apply the logged updates
k+1..last → continue at last+1.  Replay: θ = base model → apply every logged update.  Updates
run on the float32 host master through the CPU op, so both are bit-identical to the original run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from typing import Callable

import torch
import yaml

from espert.config import ESConfig
from espert.es import apply_record

FORMAT = "espert-run-v1"
CONFIG, LOG, CENTER, EXPORT, BASE = "config.yaml", "log.jsonl", "center.safetensors", "export", "base_model"
#: ESConfig fields that may change when a run is resumed (they do not change any weight or reward).
RESUMABLE_CHANGES = ("iterations", "eval_every", "checkpoint_every", "device", "trackers", "tracker_project")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")


# ---- atomic files ----------------------------------------------------------------------------------

def fsync_dir(path: str) -> None:
    """fsync a directory (makes renames in it durable); a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, write: Callable[[str], None]) -> None:
    """``write(tmp_path)``, fsync it, then ``os.replace`` it onto ``path`` and fsync the directory."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write_text(path: str, text: str) -> None:
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
    atomic_write(path, write)


# ---- the log ----------------------------------------------------------------------------------------

def read_log(path: str, repair: bool = False) -> list[dict]:
    """Records of a run log.  A torn last line is dropped (and, with ``repair``, cut from the file).

    Raises ValueError for a damaged line that is not the last one.
    """
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        data = f.read()
    records, pos = [], 0
    while pos < len(data):
        end = data.find(b"\n", pos)
        line = data[pos:] if end < 0 else data[pos:end]
        rec = None
        if end >= 0:
            try:
                rec = json.loads(line)
            except ValueError:
                rec = None
        if not isinstance(rec, dict):
            if end >= 0 and data[end + 1:].strip(b"\x00 \n\r\t"):
                raise ValueError(f"{path}: damaged record at byte {pos} (not the last line); refusing to guess")
            if repair:  # torn tail: the process died while writing it
                with open(path, "rb+") as f:
                    f.truncate(pos)
                    os.fsync(f.fileno())
            break
        records.append(rec)
        pos = end + 1
    return records


def iteration_records(records: list[dict]) -> list[dict]:
    """The ``iter`` records, checked to be iterations 1..last without gaps or repeats."""
    its = [r for r in records if r.get("kind") == "iter"]
    for i, r in enumerate(its, 1):
        if r.get("iteration") != i:
            raise ValueError(f"run log: expected iteration {i}, found {r.get('iteration')}")
    return its


# ---- centers and exports --------------------------------------------------------------------------

def save_center(path: str, state: dict[str, torch.Tensor], iteration: int) -> None:
    """Atomically write the float32 center (logical names) with its iteration as metadata."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt", "espert": FORMAT,
                                                                     "iteration": str(iteration)}))


def load_center(path: str) -> tuple[dict[str, torch.Tensor], int]:
    """``(state, iteration)`` of a center checkpoint."""
    from safetensors import safe_open

    if not os.path.exists(path):
        raise FileNotFoundError(f"center checkpoint not found: {path}")
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        if "iteration" not in meta:
            raise ValueError(f"{path} is not an espert center checkpoint (no iteration in its metadata)")
        return {k: f.get_tensor(k) for k in f.keys()}, int(meta["iteration"])


def resolve_model_dir(ref: str) -> str:
    """A local directory holding the model files of ``ref`` (a directory, or a Hub id in the local cache)."""
    if os.path.isdir(ref):
        return ref
    if os.path.sep in ref or ref.startswith("."):
        raise FileNotFoundError(f"model directory not found: {ref}")
    from huggingface_hub import snapshot_download  # pragma: no cover - needs a Hub model

    try:  # pragma: no cover
        return snapshot_download(ref, local_files_only=True)
    except Exception:  # pragma: no cover
        return snapshot_download(ref, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja",
                                                      "*.tiktoken"])


def export_model(state: dict[str, torch.Tensor], base_ref: str, out_dir: str, iteration: int | None = None,
                 note: dict | None = None) -> str:
    """Write the center in the base model's own format to ``out_dir`` (replaced atomically as a whole).

    Copies the base model's non-weight files (config, tokenizer, generation config, chat template)
    and rewrites each of its ``*.safetensors`` files with every tensor named in ``state`` replaced
    by the center, cast (round to nearest even) to that tensor's dtype in the base file.  The shard
    layout and index stay those of the base, so ``AutoModelForCausalLM.from_pretrained`` and vLLM
    load the result like the base.  Raises if a center name is missing from the base checkpoint.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    base = resolve_model_dir(base_ref)
    files = sorted(os.listdir(base))
    shards = [f for f in files if f.endswith(".safetensors")]
    if not shards:
        raise ValueError(f"{base} has no *.safetensors weights; export needs a safetensors checkpoint")
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp, old = f"{out_dir}.tmp-{os.getpid()}", f"{out_dir}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        for f in files:
            src = os.path.join(base, f)
            if os.path.isfile(src) and not f.endswith(WEIGHT_SUFFIXES):
                shutil.copyfile(src, os.path.join(tmp, f))
        found = set()
        for shard in shards:
            with safe_open(os.path.join(base, shard), framework="pt") as fh:
                meta = fh.metadata() or {"format": "pt"}
                tensors = {}
                for k in fh.keys():
                    t = fh.get_tensor(k)
                    if k in state:
                        c = state[k]
                        if tuple(c.shape) != tuple(t.shape):
                            raise ValueError(f"center {k} has shape {tuple(c.shape)}, base has {tuple(t.shape)}")
                        c = c.detach().to("cpu")
                        if not t.dtype.is_floating_point and c.dtype.is_floating_point:
                            # integer codes (e.g. a W8A8 master in code units): round, don't truncate
                            info = torch.iinfo(t.dtype)
                            c = c.round().clamp(info.min, info.max)
                        t = c.to(t.dtype).contiguous()
                        found.add(k)
                    tensors[k] = t
            save_file(tensors, os.path.join(tmp, shard), metadata=meta)
        missing = sorted(set(state) - found)
        if missing:
            raise ValueError(f"the base checkpoint {base} has no tensors named {missing[:3]}"
                             f"{' ...' if len(missing) > 3 else ''}; cannot export in its format")
        with open(os.path.join(tmp, "espert_export.json"), "w", encoding="utf-8") as fh:
            json.dump({"iteration": iteration, "base_model": base_ref, **(note or {})}, fh, indent=2)
        for f in os.listdir(tmp):
            with open(os.path.join(tmp, f), "rb+") as fh:
                os.fsync(fh.fileno())
        fsync_dir(tmp)
        if os.path.exists(out_dir):
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        fsync_dir(parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return out_dir


def base_fingerprint(ref: str) -> dict | None:
    """A cheap identity of a local base model: sha256 of config.json and the weight files' names and sizes."""
    if not os.path.isdir(ref):
        return None
    h = hashlib.sha256()
    cfg = os.path.join(ref, "config.json")
    if os.path.exists(cfg):
        with open(cfg, "rb") as f:
            h.update(f.read())
    for f in sorted(os.listdir(ref)):
        if f.endswith(WEIGHT_SUFFIXES):
            h.update(f"{f}:{os.path.getsize(os.path.join(ref, f))}\n".encode())
    return {"sha256": h.hexdigest()}


# ---- the run ---------------------------------------------------------------------------------------

def read_run_config(run_dir: str) -> dict:
    """The parsed ``config.yaml`` of a run directory (clear errors when it is not one)."""
    path = os.path.join(run_dir, CONFIG)
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{run_dir} is not an espert run directory (no {CONFIG})")
    with open(path, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or "config" not in doc:
        raise ValueError(f"{path}: not an espert run config (format {FORMAT})")
    return doc


class Run:
    """A run directory opened for training (new or resumed)."""

    def __init__(self, path: str, cfg: ESConfig, doc: dict, echo: Callable[[str], None] | None = print):
        self.path, self.cfg, self.doc = path, cfg, doc
        self.echo = echo or (lambda s: None)
        self.records = read_log(self.file(LOG), repair=True)
        self._cleanup()
        self._log = open(self.file(LOG), "a", encoding="utf-8")

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
        """Where the base model is: the run's own ``base_model/`` (tiny), a local directory or a Hub id."""
        ref = self.doc["base_model"]
        return self.file(ref) if ref == BASE else ref

    # -- opening --
    @classmethod
    def open(cls, run_dir: str, cfg: ESConfig | None, resume: bool = False,
             echo: Callable[[str], None] | None = print) -> "Run":
        """Create a new run in ``run_dir`` or (``resume``) reopen it.

        A new run refuses a directory that already holds a run.  On resume, ``cfg`` must equal the
        stored config except for :data:`RESUMABLE_CHANGES` (``iterations`` only with constant
        schedules); anything else raises ValueError listing the differences.
        """
        exists = os.path.exists(os.path.join(run_dir, CONFIG)) or os.path.exists(os.path.join(run_dir, LOG))
        if resume:
            doc = read_run_config(run_dir)
            stored = ESConfig.from_dict(doc["config"])
            cfg = cfg or stored
            diff = {k: (getattr(stored, k), getattr(cfg, k)) for k in stored.to_dict()
                    if getattr(stored, k) != getattr(cfg, k)}
            bad = {k: v for k, v in diff.items() if k not in RESUMABLE_CHANGES}
            if "iterations" in diff and (cfg.sigma_schedule != "constant" or cfg.alpha_schedule != "constant"):
                bad["iterations"] = diff["iterations"]
            if bad:
                lines = "; ".join(f"{k}: run has {a!r}, given {b!r}" for k, (a, b) in sorted(bad.items()))
                raise ValueError(f"config mismatch on resume of {run_dir}: {lines}. Resume with the run's own "
                                 f"config (only {', '.join(RESUMABLE_CHANGES)} may change; iterations only with "
                                 f"constant schedules), or start a new run directory.")
            run = cls(run_dir, cfg, doc, echo)
            run._ensure_base()
            if diff:
                run.doc["config"] = cfg.to_dict()
                run._write_config()
                run.echo(f"[espert] resume: changed {', '.join(f'{k}={b!r}' for k, (_, b) in diff.items())}")
            return run
        if cfg is None:
            raise ValueError("a new run needs a config (cfg=None is only for resuming)")
        if exists:
            raise FileExistsError(f"{run_dir} already holds an espert run; pass --resume to continue it, or choose "
                                  f"another --run-dir")
        os.makedirs(run_dir, exist_ok=True)
        ref = BASE if cfg.model == "tiny" else (os.path.abspath(cfg.model) if os.path.isdir(cfg.model) else cfg.model)
        if ref != BASE and (os.path.sep in cfg.model) and not os.path.isdir(cfg.model):
            raise FileNotFoundError(f"model directory not found: {cfg.model}")
        from espert import __version__

        doc = {"format": FORMAT, "espert_version": __version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "base_model": ref, "base_fingerprint": None, "task": cfg.task, "config": cfg.to_dict()}
        run = cls(run_dir, cfg, doc, echo)
        run._ensure_base()
        run.doc["base_fingerprint"] = base_fingerprint(run.base_path)
        run._write_config()
        return run

    def _write_config(self) -> None:
        atomic_write_text(self.file(CONFIG), yaml.safe_dump(self.doc, sort_keys=False, default_flow_style=None))

    def _ensure_base(self) -> None:
        """Build the tiny base model if the run uses one and it is missing (deterministic in tiny_seed);
        check the base fingerprint when one is stored."""
        if self.doc["base_model"] == BASE and not os.path.exists(os.path.join(self.base_path, "config.json")):
            from espert.tiny import build_tiny_model

            tmp = self.file(f".{BASE}.tmp-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            build_tiny_model(tmp, seed=self.cfg.tiny_seed)
            shutil.rmtree(self.base_path, ignore_errors=True)
            os.replace(tmp, self.base_path)
            fsync_dir(self.path)
        want = self.doc.get("base_fingerprint")
        if want is not None and base_fingerprint(self.base_path) != want:
            raise ValueError(f"the base model at {self.base_path} is not the one this run started from "
                             f"(fingerprint mismatch); replay and resume need the original base model")

    # -- log --
    def append(self, rec: dict) -> None:
        """Append one record as a whole line, flushed and fsynced."""
        self._log.write(json.dumps(rec, allow_nan=False, separators=(",", ":")) + "\n")
        self._log.flush()
        os.fsync(self._log.fileno())
        self.records.append(rec)

    def iterations(self) -> list[dict]:
        return iteration_records(self.records)

    def last_iteration(self) -> int:
        its = self.iterations()
        return its[-1]["iteration"] if its else 0

    def last_eval(self) -> dict | None:
        evals = [r for r in self.records if r.get("kind") == "eval"]
        return evals[-1] if evals else None

    # -- state --
    def checkpoint_iteration(self) -> int | None:
        if not os.path.exists(self.file(CENTER)):
            return None
        from safetensors import safe_open

        with safe_open(self.file(CENTER), framework="pt") as f:
            return int((f.metadata() or {}).get("iteration", -1))

    def restore(self, evaluator) -> int:
        """Bring the evaluator's center to the last logged iteration: checkpoint, then replay the log tail."""
        its = self.iterations()
        last = its[-1]["iteration"] if its else 0
        start = 0
        if os.path.exists(self.file(CENTER)):
            state, start = load_center(self.file(CENTER))
            if start > last:
                raise ValueError(f"{self.file(CENTER)} is at iteration {start} but the log ends at {last}")
            evaluator.load_center(state)
        for rec in its[start:]:
            apply_record(evaluator, rec)
        if last:
            self.echo(f"[espert] resumed at iteration {last} (checkpoint {start} + {last - start} replayed updates)")
        return last

    def checkpoint(self, evaluator, t: int) -> None:
        """Save the center at iteration t and export it in the base model's format."""
        save_center(self.file(CENTER), evaluator.center_state(), t)
        export_model(evaluator.export_state(), self.base_path, self.file(EXPORT), iteration=t,
                     note={"run": os.path.abspath(self.path)})

    def evaluate_heldout(self, evaluator, task, t: int) -> dict:
        """Mean reward of the center θ_t on the held-out problems; logged as an ``eval`` record."""
        t0 = time.time()
        rewards = evaluator.evaluate_center(task.prompts, task.answers)
        rec = {"kind": "eval", "iteration": t, "mean": sum(rewards) / len(rewards) if rewards else None,
               "n": len(rewards), "seconds": round(time.time() - t0, 4), "time": time.time()}
        self.append(rec)
        return rec

    def summary(self) -> dict:
        evals = [r for r in self.records if r.get("kind") == "eval"]
        its = self.iterations()
        return {"run_dir": self.path, "iterations": len(its), "heldout": [(r["iteration"], r["mean"]) for r in evals],
                "train_reward": [(r["iteration"], r["reward"]["mean"]) for r in its],
                "export": self.file(EXPORT) if os.path.isdir(self.file(EXPORT)) else None}

    def close(self) -> None:
        self._log.close()


# ---- helpers used by the loop and the CLI ---------------------------------------------------------------

def load_tasks(cfg: ESConfig):
    """``(train_task, eval_task or None)`` from the config."""
    from espert.tasks import load_task

    train = load_task(cfg.task, "train", n=cfg.train_size, path=cfg.train_data)
    if len(train) == 0:
        raise ValueError(f"task {cfg.task!r} has no training problems")
    evalt = None
    if cfg.eval_size > 0:
        evalt = load_task(cfg.task, cfg.eval_split, n=cfg.eval_size, path=cfg.eval_data)
    return train, evalt


def build_run_evaluator(run: Run, train_task):
    from espert.evaluators import build_evaluator

    return build_evaluator(run.cfg, run.base_path, train_task.score)


class _CenterTarget:
    """Adapter so replay applies records through the same ``apply_record`` as training."""

    def __init__(self, center):
        self.center = center

    def update(self, seeds, coeffs, decay=1.0):
        from espert.evaluators import apply_update

        apply_update(self.center, seeds, coeffs, decay)


def replay(run_dir: str, out_dir: str | None = None, upto: int | None = None,
           echo: Callable[[str], None] | None = print) -> dict:
    """Rebuild a run's center from its base model and log alone, on the CPU.

    Writes ``OUT/center.safetensors`` and ``OUT/export/`` (default OUT: RUN/replay) and compares
    with the run's own checkpoint when that is at the same iteration.  upto: stop after this
    iteration (default: the last logged one).  Returns ``{"iteration", "out", "matches_checkpoint"}``
    (``matches_checkpoint`` is None when there is nothing to compare with).
    """
    from espert.evaluators import load_model, model_center

    echo = echo or (lambda s: None)
    doc = read_run_config(run_dir)
    cfg = ESConfig.from_dict(doc["config"])
    base = os.path.join(run_dir, BASE) if doc["base_model"] == BASE else doc["base_model"]
    want = doc.get("base_fingerprint")
    if want is not None and base_fingerprint(base) != want:
        raise ValueError(f"the base model at {base} is not the one the run started from (fingerprint mismatch)")
    its = iteration_records(read_log(os.path.join(run_dir, LOG)))
    if upto is not None:
        if not 0 <= upto <= len(its):
            raise ValueError(f"--upto {upto} is outside the logged iterations 0..{len(its)}")
        its = its[:upto]
    model, _ = load_model(base, device="cpu", dtype=cfg.dtype)
    if cfg.quant != "none":  # the same quantization as training, then the quantized center
        from espert.quant import model_quant_center, quantize_model

        center = model_quant_center(quantize_model(model, cfg.quant, group_size=cfg.quant_group_size))
    else:
        center = model_center(model, cfg.include, cfg.exclude)
    target = _CenterTarget(center)
    t0 = time.time()
    for rec in its:
        apply_record(target, rec)
    last = its[-1]["iteration"] if its else 0
    out_dir = out_dir or os.path.join(run_dir, "replay")
    os.makedirs(out_dir, exist_ok=True)
    state = center.state_dict()
    save_center(os.path.join(out_dir, CENTER), state, last)
    export_model(center.export_state(), base, os.path.join(out_dir, EXPORT), iteration=last,
                 note={"replayed_from": run_dir})
    match = None
    ck = os.path.join(run_dir, CENTER)
    if os.path.exists(ck):
        ref, k = load_center(ck)
        if k == last:
            match = set(ref) == set(state) and all(torch.equal(ref[n], state[n]) for n in state)
    echo(f"[espert] replayed {len(its)} updates in {time.time() - t0:.1f}s -> {out_dir}"
         + ("" if match is None else f"; bit-identical to {ck}: {'yes' if match else 'NO'}"))
    return {"iteration": last, "out": out_dir, "matches_checkpoint": match}
