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

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import time
import zlib
from typing import Callable, Iterator, Mapping

import torch
import yaml

from espert.config import ESConfig, stored_run_config
from espert.es import apply_record
from espert.tensorfile import (
    ST_TORCH,
    FileChunks,
    TensorFileWriter,
    as_chunks,
    read_header,
    write_chunks,
    write_safetensors,  # noqa: F401 - re-exported: run files are written with it
)

FORMAT = "espert-run-v1"
CONFIG, LOG, CENTER, EXPORT, BASE = "config.yaml", "log.jsonl", "center.safetensors", "export", "base_model"
#: ESConfig fields that may change when a run is resumed (they do not change any weight or reward).
RESUMABLE_CHANGES = ("iterations", "eval_every", "checkpoint_every", "device", "trackers", "tracker_project")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")
#: Files of a model directory that its fingerprint covers: weights, configs, tokenizer, remote code.
MODEL_SUFFIXES = WEIGHT_SUFFIXES + (".json", ".model", ".txt", ".tiktoken", ".jinja", ".py")
KILL_ENV = "ESPERT_TEST_KILL_AT"


class RunError(ValueError):
    """A run directory (or one of its files) is damaged or does not match; the message names the file."""


def kill_point(name: str, iteration: int | None = None) -> None:
    """SIGKILL this process here when ``ESPERT_TEST_KILL_AT`` is ``name`` or ``name:iteration`` (chaos tests)."""
    want = os.environ.get(KILL_ENV)
    if want and want in (name, f"{name}:{iteration}"):
        os.kill(os.getpid(), signal.SIGKILL)


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


def atomic_write(path: str, write: Callable[[str], object], before_replace: Callable[[object], None] | None = None):
    """``r = write(tmp_path)``, fsync it, ``before_replace(r)``, then ``os.replace`` it onto ``path`` and fsync
    the directory.  Returns r."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        r = write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        if before_replace is not None:
            before_replace(r)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    return r


def atomic_write_text(path: str, text: str) -> None:
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    atomic_write(path, write)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


# ---- the log ----------------------------------------------------------------------------------------


def _body(rec: dict) -> str:
    return json.dumps(rec, allow_nan=False, separators=(",", ":"))


def log_line(rec: dict) -> bytes:
    """One log line: the record's compact JSON with a ``crc32`` of that JSON appended as its last key."""
    body = _body(rec)
    crc = f'"crc32":"{zlib.crc32(body.encode()):08x}"'
    return (body[:-1] + ("," if len(rec) else "") + crc + "}\n").encode()


def _parse_line(line: bytes) -> tuple[dict | None, str]:
    """``(record, "")`` or ``(None, problem)``; a record whose crc32 does not match is a problem."""
    try:
        rec = json.loads(line)
    except ValueError as e:
        return None, f"not valid JSON ({e})"
    if not isinstance(rec, dict):
        return None, "not a JSON object"
    crc = rec.pop("crc32", None)  # records written before checksums have none
    if crc is not None and crc != f"{zlib.crc32(_body(rec).encode()):08x}":
        return None, "checksum mismatch (the line was changed after it was written)"
    return rec, ""


def read_log(path: str, repair: bool = False) -> list[dict]:
    """Records of a run log.  A torn last line (no newline) is dropped (and, with ``repair``, cut from the file).

    Raises :class:`RunError` naming the file and line for any other damage: a complete line (one
    that ends in a newline) that is not valid JSON or fails its checksum, wherever it is.
    """
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        data = f.read()
    records, pos, lineno = [], 0, 0
    while pos < len(data):
        lineno += 1
        end = data.find(b"\n", pos)
        if end < 0:  # torn tail: the process died while writing it (its update was never applied)
            if repair:
                with open(path, "rb+") as f:
                    f.truncate(pos)
                    os.fsync(f.fileno())
            break
        rec, problem = _parse_line(data[pos:end])
        if rec is None:
            where = "the last line" if not data[end + 1 :] else "not the last line"
            raise RunError(
                f"{path}: line {lineno} is damaged: {problem} ({where}); refusing to guess. The "
                f"records before it are intact; restore the file from a backup, or replay up to "
                f"the last intact iteration"
            )
        records.append(rec)
        pos = end + 1
    return records


def iteration_records(records: list[dict], path: str = LOG) -> list[dict]:
    """The ``iter`` records, checked to be iterations 1..last without gaps or repeats."""
    its = [r for r in records if r.get("kind") == "iter"]
    for i, r in enumerate(its, 1):
        if r.get("iteration") != i:
            raise RunError(f"{path}: expected iteration {i}, found {r.get('iteration')}")
    return its


def checkpoint_hashes(records: list[dict]) -> dict[str, int]:
    """sha256 -> iteration of every checkpoint the log recorded."""
    return {r["sha256"]: r["iteration"] for r in records if r.get("kind") == "checkpoint" and "sha256" in r}


# ---- centers and exports --------------------------------------------------------------------------


def save_center(path: str, state, iteration: int, before_replace: Callable[[str], None] | None = None) -> str:
    """Atomically write the center (logical names) with its iteration as metadata; returns the file's sha256.

    state: ``{name: tensor}`` or a chunk source (:mod:`espert.tensorfile`, e.g. an evaluator's
    ``center_stream()``: then the driver holds one chunk, never the center); both give the same bytes.
    before_replace(sha256) runs once the new file is complete and before it replaces the old one
    (the run logs the checksum there).
    """

    def write(tmp):
        sha = write_chunks(tmp, state, {"format": "pt", "espert": FORMAT, "iteration": str(iteration)})
        kill_point("center-written", iteration)
        return sha

    return atomic_write(path, write, before_replace)


class CenterFile(Mapping):
    """A center checkpoint's tensors, each read from the file when asked for (``load_center(lazy=True)``):
    a resume hands the center to the evaluator one tensor at a time (a vLLM engine gets one message per
    tensor), so the driver never holds the whole center."""

    def __init__(self, path: str, keys: list[str]):
        self.path, self._keys = path, list(keys)

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self._keys:
            raise KeyError(name)
        with safe_open(self.path, framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def load_center(
    path: str, known: dict[str, int] | None = None, lazy: bool = False
) -> tuple[Mapping[str, torch.Tensor], int]:
    """``(state, iteration)`` of a center checkpoint.

    known: sha256 -> iteration of the checkpoints a run logged; when given (and not empty), the
    file must be one of them.  lazy: ``state`` is a :class:`CenterFile` (header and checksum checked
    now, tensors read when asked for) instead of a dict.  Raises FileNotFoundError, or
    :class:`RunError` naming the file and the problem (empty, checksum not in the log, not a
    safetensors file, no iteration).
    """
    from safetensors import safe_open

    if not os.path.exists(path):
        raise FileNotFoundError(f"center checkpoint not found: {path}")
    size = os.path.getsize(path)
    if size == 0:
        raise RunError(f"{path}: damaged center checkpoint: the file is empty (0 bytes)")
    if known:
        sha = sha256_file(path)
        if sha not in known:
            raise RunError(
                f"{path}: damaged center checkpoint: its sha256 ({sha[:16]}…, {size} bytes) is none of the "
                f"{len(known)} checkpoint(s) recorded in {LOG}"
            )
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            state = CenterFile(path, sorted(f.keys())) if lazy else {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for every kind of damage
        raise RunError(
            f"{path}: damaged center checkpoint: not a readable safetensors file "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    if "iteration" not in meta or not str(meta["iteration"]).isdigit():
        raise RunError(f"{path} is not an espert center checkpoint (no iteration in its metadata)")
    it = int(meta["iteration"])
    if known and known[sha] != it:
        raise RunError(
            f"{path}: damaged center checkpoint: metadata says iteration {it}, the log recorded "
            f"this file as iteration {known[sha]}"
        )
    return state, it


def is_hub_id(ref: str) -> bool:
    """A Hugging Face Hub id (``name`` or ``org/name``) rather than a path."""
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?", ref)) and ".." not in ref


def resolve_model_dir(ref: str) -> str:
    """A local directory holding the model files of ``ref``: a directory, or a Hub id (local cache first).

    Fails fast with one clear message when the model is neither a directory nor in the local cache
    and the Hub does not answer, or has no such model.
    """
    if os.path.isdir(ref):
        return ref
    if not is_hub_id(ref):
        raise FileNotFoundError(f"model directory not found: {ref}")
    from huggingface_hub import constants, snapshot_download

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
    try:
        return snapshot_download(ref, allow_patterns=patterns, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached: ask the Hub below
        pass
    where = f"the Hugging Face Hub ({constants.ENDPOINT})"
    if constants.HF_HUB_OFFLINE:
        raise FileNotFoundError(
            f"model {ref!r} is not a local directory and not in the local Hugging Face cache, and HF_HUB_OFFLINE is set"
        )
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:  # one short request first, so an unreachable Hub costs seconds, not a minute of retries
        HfApi().model_info(ref, timeout=10)
    except GatedRepoError:
        raise FileNotFoundError(
            f"model {ref!r} on {where} is gated: accept its license and log in (hf auth login)"
        ) from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(
            f"model {ref!r}: no such local directory, and no such model on {where} "
            f"(or it is private: log in with hf auth login)"
        ) from None
    except HfHubHTTPError as e:
        code = getattr(getattr(e, "response", None), "status_code", None)
        raise FileNotFoundError(
            f"model {ref!r} is not a local directory or cached, and {where} answered "
            f"HTTP {code}: {str(e).splitlines()[0]}"
        ) from None
    except Exception as e:  # noqa: BLE001 - network errors come from several libraries
        raise FileNotFoundError(
            f"model {ref!r} is not a local directory or cached, and {where} cannot be "
            f"reached ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    return snapshot_download(ref, allow_patterns=patterns)


def _cast(c: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Center values as ``dtype`` (round to nearest even; elementwise, so a chunk casts like its tensor)."""
    c = c.detach().to("cpu")
    if not dtype.is_floating_point and c.dtype.is_floating_point:
        # integer codes (e.g. a W8A8 master in code units): round, don't truncate
        info = torch.iinfo(dtype)
        c = c.round().clamp(info.min, info.max)
    return c.to(dtype)


def export_model(state, base_ref: str, out_dir: str, iteration: int | None = None, note: dict | None = None) -> str:
    """Write the center in the base model's own format to ``out_dir`` (replaced atomically as a whole).

    state: ``{name: tensor}`` (an evaluator's ``export_state()``) or a chunk source
    (:mod:`espert.tensorfile`, e.g. ``center_stream()``; driver memory: about one chunk).
    Entries named ``optim.*`` (optimizer state) are not weights and are skipped.  Copies the base
    model's non-weight files (config, tokenizer, generation config, chat template) and rewrites
    each of its ``*.safetensors`` files with every tensor named in ``state`` replaced by the center,
    cast (round to nearest even) chunk by chunk to that tensor's dtype in the base file; the other
    tensors are copied.  The shard layout and index stay those of the base, so
    ``AutoModelForCausalLM.from_pretrained`` and vLLM load the result like the base.  Raises (before
    writing) if a center name is missing from the base checkpoint or has another shape there.
    """
    from espert.center import OPTIM_PREFIX

    source = as_chunks(state)
    names = {n: shape for n, (shape, _) in source.layout.items() if not n.startswith(OPTIM_PREFIX)}
    base = resolve_model_dir(base_ref)
    files = sorted(os.listdir(base))
    shards = [f for f in files if f.endswith(".safetensors")]
    if not shards:
        raise ValueError(f"{base} has no *.safetensors weights; export needs a safetensors checkpoint")
    heads = {shard: read_header(os.path.join(base, shard)) for shard in shards}
    where: dict[str, str] = {}  # center name -> its shard
    for shard, (_, entries, _) in heads.items():
        for k, e in entries.items():
            if k in names:
                if tuple(names[k]) != tuple(e["shape"]):
                    raise ValueError(f"center {k} has shape {tuple(names[k])}, base has {tuple(e['shape'])}")
                where[k] = shard
            if e["dtype"] not in ST_TORCH:
                raise ValueError(f"{os.path.join(base, shard)}: cannot store {k} of dtype {e['dtype']} in safetensors")
    missing = sorted(set(names) - set(where))
    if missing:
        raise ValueError(
            f"the base checkpoint {base} has no tensors named {missing[:3]}"
            f"{' ...' if len(missing) > 3 else ''}; cannot export in its format"
        )
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
        piece = max(1, int(source.chunk_bytes))
        with contextlib.ExitStack() as stack:  # every shard open at once: the center's chunks come in its order
            writers: dict[str, TensorFileWriter] = {}
            for shard, (meta, _, _) in heads.items():
                others = FileChunks(os.path.join(base, shard), piece, skip=where)  # the base's other tensors
                w = TensorFileWriter(os.path.join(tmp, shard), others.layout, meta or {"format": "pt"}, piece)
                writers[shard] = stack.enter_context(w)
                for k, offset, flat in others:
                    w.write(k, offset, flat)
            for k, offset, flat in source:
                if k in where:
                    w = writers[where[k]]
                    w.write(k, offset, _cast(flat, w.layout[k][1]))
                del flat  # a streamed chunk is freed before the next one arrives
        with open(os.path.join(tmp, "espert_export.json"), "w", encoding="utf-8") as fh:
            json.dump({"iteration": iteration, "base_model": base_ref, **(note or {})}, fh, indent=2)
        for f in os.listdir(tmp):
            with open(os.path.join(tmp, f), "rb+") as fh:
                os.fsync(fh.fileno())
        fsync_dir(tmp)
        if os.path.exists(out_dir):
            os.replace(out_dir, old)
            kill_point("export-swap", iteration)
        os.replace(tmp, out_dir)
        fsync_dir(parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return out_dir


def export_iteration(export_dir: str) -> int | None:
    """The iteration an export directory holds (None: absent or unreadable)."""
    try:
        with open(os.path.join(export_dir, "espert_export.json"), encoding="utf-8") as f:
            it = json.load(f).get("iteration")
    except (OSError, ValueError, AttributeError):
        return None
    return it if isinstance(it, int) else None


# ---- the base model's fingerprint --------------------------------------------------------------------


def _stat_key(st: os.stat_result) -> str:
    # ctime and inode change whenever a file is rewritten or replaced, and cannot be set back by hand
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"


def base_fingerprint(ref: str, known: dict | None = None) -> dict | None:
    """The identity of a local model directory: ``{"version": 2, "files": {name: {"size", "sha256", "stat"}}}``.

    Covers every top-level file with a suffix in :data:`MODEL_SUFFIXES` (weights, configs,
    tokenizer).  known: a fingerprint stored earlier; a file whose size, times and inode are
    unchanged keeps its stored sha256 instead of being hashed again (hash once).
    """
    if not os.path.isdir(ref):
        return None
    old = (known or {}).get("files", {})
    files = {}
    for name in sorted(os.listdir(ref)):
        p = os.path.join(ref, name)
        if name.startswith(".") or not name.endswith(MODEL_SUFFIXES) or not os.path.isfile(p):
            continue
        st = os.stat(p)
        key = _stat_key(st)
        prev = old.get(name)
        sha = prev["sha256"] if prev and prev.get("stat") == key else sha256_file(p)
        files[name] = {"size": st.st_size, "sha256": sha, "stat": key}
    return {"version": 2, "files": files}


def _fingerprint_v1(ref: str) -> dict:
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


def check_base(path: str, want: dict | None, echo: Callable[[str], None] | None = None) -> None:
    """Raise :class:`RunError` saying what changed unless the model at ``path`` is the one ``want`` describes.

    An old (version 1) fingerprint is compared as far as it goes (config.json, weight file names and
    sizes), and a note says that the weight contents cannot be verified.
    """
    if want is None:
        return
    if not os.path.isdir(path):
        raise RunError(f"the base model directory {path} is missing")
    if "files" not in want:
        if _fingerprint_v1(path) != want:
            raise RunError(
                f"the base model at {path} is not the one this run started from: config.json or the "
                f"weight files' names or sizes differ. Replay and resume need the original base model"
            )
        if echo:
            echo(
                f"[espert] note: this run directory records only config.json and weight file sizes of its base "
                f"model (older espert), so the weight contents at {path} cannot be verified"
            )
        return
    have = base_fingerprint(path, want)["files"]
    old = want["files"]
    changes = [f"{n}: missing" for n in sorted(set(old) - set(have))]
    changes += [f"{n}: new file" for n in sorted(set(have) - set(old))]
    for n in sorted(set(old) & set(have)):
        a, b = old[n], have[n]
        if a["size"] != b["size"]:
            changes.append(f"{n}: size changed ({a['size']} -> {b['size']} bytes)")
        elif a["sha256"] != b["sha256"]:
            changes.append(f"{n}: contents changed (sha256 {a['sha256'][:12]}… -> {b['sha256'][:12]}…)")
    if changes:
        raise RunError(
            f"the base model at {path} is not the one this run started from: {'; '.join(changes)}. "
            f"Replay and resume need the original base model"
        )


# ---- checks before anything is written ---------------------------------------------------------------


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
    """What ``config.yaml`` records as ``base_model``: ``base_model`` (tiny), an absolute directory, or a Hub id."""
    if cfg.model == "tiny":
        return BASE
    return os.path.abspath(cfg.model) if os.path.isdir(cfg.model) else cfg.model


def check_inputs(cfg: ESConfig, ref: str) -> None:
    """Everything a run needs that can be checked before its directory is written: the device, the data
    files, the base model ``ref`` (as :func:`model_ref` gives it; resolved now: a Hub id is downloaded,
    or fails fast)."""
    check_device(cfg.device)
    for name in ("train_data", "eval_data"):
        p = getattr(cfg, name)
        if p is not None and not os.path.exists(p):
            raise FileNotFoundError(f"{name} not found: {p}")
    if ref != BASE:
        resolve_model_dir(ref)


# ---- the run ---------------------------------------------------------------------------------------


def read_config_file(path: str):
    """The parsed YAML (``.yaml``/``.yml``/anything else) or TOML (``.toml``) document at ``path``.

    Raises FileNotFoundError, or ValueError with one line naming the file and the position of a
    syntax error.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"config file not found: {path}")
    if path.endswith(".toml"):
        import tomllib

        try:
            with open(path, "rb") as f:
                return tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: invalid TOML: {e}") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: invalid TOML: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        what = " ".join(str(x) for x in (e.context, e.problem) if x)
        raise ValueError(f"{path}: invalid YAML at {where}{what}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: invalid YAML: {str(e).splitlines()[0]}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: invalid YAML: not UTF-8 text ({e.reason} at byte {e.start})") from None


def build_tiny_base(path: str, cfg: ESConfig) -> None:
    """The tiny base model of a run with ``model: tiny``, written to ``path``: random init from
    ``tiny_seed``, then ``pretrain_steps`` of pretraining on the copy/reverse mixture (deterministic)."""
    from espert.tiny import build_tiny_model

    build_tiny_model(
        path, seed=cfg.tiny_seed, pretrain_steps=cfg.pretrain_steps, reverse_share=cfg.pretrain_reverse_share
    )


def read_run_config(run_dir: str) -> dict:
    """The parsed ``config.yaml`` of a run directory (clear errors when it is not one)."""
    path = os.path.join(run_dir, CONFIG)
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{run_dir} is not an espert run directory (no {CONFIG})")
    doc = read_config_file(path)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("config"), dict):
        raise RunError(f"{path}: not an espert run config (format {FORMAT})")
    doc["config"] = stored_run_config(doc["config"])
    return doc


def _holds_run(run_dir: str) -> bool:
    return any(os.path.exists(os.path.join(run_dir, n)) for n in (CONFIG, LOG, CENTER, EXPORT))


def _abandoned_setup(run_dir: str) -> bool:
    """What a killed setup of older espert versions left: no config, an empty log, at most a base model."""
    names = set(os.listdir(run_dir))
    log = os.path.join(run_dir, LOG)
    return (
        CONFIG not in names
        and (not os.path.exists(log) or os.path.getsize(log) == 0)
        and all(n in (LOG, BASE) or n.startswith(f".{BASE}.tmp-") for n in names)
    )


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


class Run:
    """A run directory opened for training (new or resumed)."""

    def __init__(self, path: str, cfg: ESConfig, doc: dict, echo: Callable[[str], None] | None = print):
        self.path, self.cfg, self.doc = path, cfg, doc
        self.echo = echo or (lambda s: None)
        self.records = read_log(self.file(LOG), repair=True)
        self._cleanup()
        self._log = open(self.file(LOG), "ab")
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
        and renamed into place, so a kill leaves either nothing or a complete setup.  On resume,
        ``cfg`` must equal the stored config except for :data:`RESUMABLE_CHANGES` (``iterations``
        only with constant schedules); anything else raises ValueError listing the differences.
        """
        if resume:
            doc = read_run_config(run_dir)
            stored = ESConfig.from_dict(doc["config"])
            cfg = cfg or stored
            diff = {
                k: (getattr(stored, k), getattr(cfg, k))
                for k in stored.to_dict()
                if getattr(stored, k) != getattr(cfg, k)
            }
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
            check_inputs(cfg, doc["base_model"])
            run = cls(run_dir, cfg, doc, echo)
            run._ensure_base()
            if diff:
                run.doc["config"] = cfg.to_dict()
                run._write_config()
                run.echo(f"[espert] resume: changed {', '.join(f'{k}={b!r}' for k, (_, b) in diff.items())}")
            return run
        if cfg is None:
            raise ValueError("a new run needs a config (cfg=None is only for resuming)")
        if os.path.isdir(run_dir) and _holds_run(run_dir) and not _abandoned_setup(run_dir):
            raise FileExistsError(
                f"{run_dir} already holds an espert run; pass --resume to continue it, or choose another --run-dir"
            )
        if os.path.exists(run_dir) and not os.path.isdir(run_dir):
            raise FileExistsError(f"{run_dir} exists and is not a directory")
        if os.path.isdir(run_dir) and os.listdir(run_dir) and not _abandoned_setup(run_dir):
            raise FileExistsError(f"{run_dir} is not empty and holds no espert run; choose another --run-dir")
        ref = model_ref(cfg)
        check_inputs(cfg, ref)
        from espert import __version__

        doc = {
            "format": FORMAT,
            "espert_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "base_model": ref,
            "base_fingerprint": None,
            "task": cfg.task,
            "config": cfg.to_dict(),
        }
        parent, name = os.path.split(os.path.abspath(run_dir))
        os.makedirs(parent, exist_ok=True)
        _remove_stale_setups(parent, name)
        tmp = os.path.join(parent, f".{name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        try:
            if ref == BASE:
                build_tiny_base(os.path.join(tmp, BASE), cfg)
                kill_point("setup-base")
            doc["base_fingerprint"] = base_fingerprint(
                os.path.join(tmp, BASE) if ref == BASE else resolve_model_dir(ref)
            )
            atomic_write_text(os.path.join(tmp, CONFIG), _dump_config(doc))
            open(os.path.join(tmp, LOG), "wb").close()
            fsync_dir(tmp)
            kill_point("setup-done")
            if os.path.isdir(run_dir) and os.listdir(run_dir):  # an abandoned setup of an older espert
                shutil.rmtree(run_dir)
            os.replace(tmp, run_dir)  # also onto an empty directory: a single atomic rename
            fsync_dir(parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return cls(run_dir, cfg, doc, echo)

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
        check_base(self.base_path, self.doc.get("base_fingerprint"), self.echo)

    # -- log --
    def append(self, rec: dict) -> None:
        """Append one record as a whole line (with its crc32), flushed and fsynced."""
        self._log.write(log_line(rec))
        self._log.flush()
        os.fsync(self._log.fileno())
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
        if not known:  # written by an older espert: no checksum to compare with
            self.echo(f"[espert] note: {path} has no checksum in {LOG} (older espert); loaded unverified")
        self._verified = (_stat_key(os.stat(path)), it)
        return state, it

    def checkpoint_iteration(self) -> int | None:
        """The iteration of the complete checkpoint on disk: a verified center and an export of the same
        iteration; None when there is none (missing, damaged, or the export is behind)."""
        path = self.file(CENTER)
        if not os.path.exists(path):
            return None
        key = _stat_key(os.stat(path))
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
        self._verified = (_stat_key(os.stat(self.file(CENTER))), t)
        export_model(  # streamed: from the center file just written (the workers are pulled once)
            evaluator.export_state() if stream is None else FileChunks(self.file(CENTER), stream.chunk_bytes),
            self.base_path,
            self.file(EXPORT),
            iteration=t,
            note={"run": os.path.abspath(self.path)},
        )

    def finish_iteration(self, evaluator, eval_task, t: int, hook: Callable[[int, str], None] | None = None):
        """Do what iteration t's bookkeeping still lacks: its held-out evaluation and its checkpoint, when the
        config has them at t.  On resume at t this finishes an iteration a kill cut short.  Returns the
        eval record it wrote, or None."""
        cfg, T = self.cfg, self.cfg.iterations
        rec = None
        due_eval = t in (0, T) or (cfg.eval_every and t % cfg.eval_every == 0)
        if (
            eval_task is not None
            and due_eval
            and not any(r.get("kind") == "eval" and r.get("iteration") == t for r in self.records)
        ):
            rec = self.evaluate_heldout(evaluator, eval_task, t)
        due_ck = t > 0 and (t == T or (cfg.checkpoint_every and t % cfg.checkpoint_every == 0))
        if due_ck and self.checkpoint_iteration() != t:
            self.checkpoint(evaluator, t)
            if hook:
                hook(t, "checkpointed")
        return rec

    def evaluate_heldout(self, evaluator, task, t: int) -> dict:
        """Mean reward of the center θ_t on the held-out problems; logged as an ``eval`` record."""
        t0 = time.time()
        rewards = evaluator.evaluate_center(task.prompts, task.answers)
        kill_point("evaluated", t)
        rec = {
            "kind": "eval",
            "iteration": t,
            "mean": sum(rewards) / len(rewards) if rewards else None,
            "n": len(rewards),
            "seconds": round(time.time() - t0, 4),
            "time": time.time(),
        }
        self.append(rec)
        return rec

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
        self._log.close()


def _dump_config(doc: dict) -> str:
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=None)


def replay(
    run_dir: str, out_dir: str | None = None, upto: int | None = None, echo: Callable[[str], None] | None = print
) -> dict:
    """Rebuild a run's center from its base model and log alone, on the CPU.

    Writes ``OUT/center.safetensors`` and ``OUT/export/`` (default OUT: RUN/replay) and compares
    with the run's own checkpoint when that is at the same iteration.  upto: stop after this
    iteration (default: the last logged one).  Returns ``{"iteration", "out", "matches_checkpoint"}``
    (``matches_checkpoint`` is None when there is nothing to compare with, False when the
    checkpoint differs or is damaged).  Refuses (RunError) a base model that is not the run's, and a
    log that ends before the run's checkpoint or export (records are missing).
    """
    from espert.evaluators import config_center, load_model

    echo = echo or (lambda s: None)
    doc = read_run_config(run_dir)
    cfg = ESConfig.from_dict(doc["config"])
    base = os.path.join(run_dir, BASE) if doc["base_model"] == BASE else resolve_model_dir(doc["base_model"])
    check_base(base, doc.get("base_fingerprint"), echo)
    log = os.path.join(run_dir, LOG)
    records = read_log(log)
    its = iteration_records(records, log)
    last_logged = its[-1]["iteration"] if its else 0
    ck = os.path.join(run_dir, CENTER)
    ref = ck_error = None
    if os.path.exists(ck):
        try:
            ref = load_center(ck, checkpoint_hashes(records))
        except RunError as e:
            ck_error = str(e)
    ahead = max(
        [it for it in (ref and ref[1], export_iteration(os.path.join(run_dir, EXPORT))) if it is not None]
        + [r["iteration"] for r in records if r.get("kind") in ("checkpoint", "eval")],
        default=0,
    )
    if ahead > last_logged:
        raise RunError(
            f"{log} ends at iteration {last_logged}, but the run's checkpoint, export or log reached "
            f"iteration {ahead}: update records are missing, so replay cannot rebuild its weights"
        )
    if upto is not None:
        if not 0 <= upto <= len(its):
            raise ValueError(f"--upto {upto} is outside the logged iterations 0..{len(its)}")
        its = its[:upto]
    model, _ = load_model(base, device="cpu", dtype=cfg.dtype)
    center = config_center(model, cfg)  # the center training built (quantization, optimizer, decay exclusions)
    t0 = time.time()
    for rec in its:
        apply_record(center, rec)  # a Center has the Evaluator's update signature
    last = its[-1]["iteration"] if its else 0
    out_dir = out_dir or os.path.join(run_dir, "replay")
    os.makedirs(out_dir, exist_ok=True)
    state = center.state_dict()
    save_center(os.path.join(out_dir, CENTER), state, last)
    export_model(
        center.export_state(), base, os.path.join(out_dir, EXPORT), iteration=last, note={"replayed_from": run_dir}
    )
    match = None
    if ck_error is not None and upto is None:
        match = False
    elif ref is not None and ref[1] == last:
        match = set(ref[0]) == set(state) and all(torch.equal(ref[0][n], state[n]) for n in state)
    echo(
        f"[espert] replayed {len(its)} updates in {time.time() - t0:.1f}s -> {out_dir}"
        + ("" if match is None or ck_error else f"; bit-identical to {ck}: {'yes' if match else 'NO'}")
    )
    if ck_error is not None:
        echo(f"[espert] cannot compare with the run's checkpoint: {ck_error}")
    return {"iteration": last, "out": out_dir, "matches_checkpoint": match}
