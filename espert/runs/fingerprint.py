"""The base model's fingerprint: what a run records of its base model, and the check on resume and replay."""

from __future__ import annotations

import os
from typing import Callable

from espert.files import MODEL_SUFFIXES, RunError, sha256_file, stat_key
from espert.runs.gguf import SUFFIX, is_gguf
from espert.runs.legacy import check_base_v1


def base_fingerprint(ref: str, known: dict | None = None) -> dict | None:
    """The identity of a local model directory or GGUF file: ``{"version": 2, "files": {name: {"size", "sha256", "stat"}}}``.

    Covers every top-level file with a suffix in :data:`MODEL_SUFFIXES` (weights, configs,
    tokenizer).  known: a fingerprint stored earlier; a file whose size, times and inode are
    unchanged keeps its stored sha256 instead of being hashed again (hash once).
    """
    if os.path.isfile(ref) and is_gguf(ref):  # a GGUF file: the file itself (its conversion is derived)
        ref, names = os.path.split(ref)
        names = [names]
    elif os.path.isdir(ref):
        names = sorted(os.listdir(ref))
    else:
        return None
    old = (known or {}).get("files", {})
    files = {}
    for name in names:
        p = os.path.join(ref, name)
        if name.startswith(".") or not name.endswith(MODEL_SUFFIXES + (SUFFIX,)) or not os.path.isfile(p):
            continue
        st = os.stat(p)
        key = stat_key(st)
        prev = old.get(name)
        sha = prev["sha256"] if prev and prev.get("stat") == key else sha256_file(p)
        files[name] = {"size": st.st_size, "sha256": sha, "stat": key}
    return {"version": 2, "files": files}


def check_base(path: str, want: dict | None, echo: Callable[[str], None] | None = None) -> None:
    """Raise :class:`RunError` saying what changed unless the model at ``path`` is the one ``want`` describes.

    An old (version 1) fingerprint is compared as far as it goes (:func:`espert.runs.legacy.check_base_v1`).
    """
    if want is None:
        return
    if is_gguf(path):
        if not os.path.isfile(path):
            raise RunError(f"the base model's GGUF file {path} is missing")
    elif not os.path.isdir(path):
        raise RunError(f"the base model directory {path} is missing")
    if "files" not in want:  # version 1
        return check_base_v1(path, want, echo)
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
