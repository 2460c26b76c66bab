"""The write-ahead log ``log.jsonl``: one JSON object per line, each with a ``crc32`` of the rest of the line.

On open, a torn last line (no newline: the process died mid-write) is dropped and the file
truncated to the last complete line; any other damage (bad JSON, a checksum mismatch, also on a
complete last line) is an error naming the file and line.
"""

from __future__ import annotations

import json
import os
import zlib

from espert.files import LOG, RunError
from espert.runs import legacy


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
    crc = rec.pop("crc32", None)
    if not legacy.unchecked_line(crc) and crc != f"{zlib.crc32(_body(rec).encode()):08x}":
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
            kept = sum(r.get("kind") == "iter" for r in records)
            raise RunError(
                f"{path}: line {lineno} is damaged: {problem} ({where}); refusing to guess. The "
                f"records before it are intact; restore the file from a backup, or keep iterations "
                f"1..{kept} with: espert repair {os.path.dirname(os.path.abspath(path))} --truncate-after {kept}"
            )
        records.append(rec)
        pos = end + 1
    return records


def iteration_records(records: list[dict], path: str = LOG) -> list[dict]:
    """The ``iter`` records, checked to be iterations 1..last without gaps or repeats.

    ``records`` are a whole log's (record k is line k + 1).  A repeat or a gap (two writers, or two
    histories joined) is a :class:`RunError` naming the file, the line and the iteration, and the
    exact recovery: ``espert repair RUN --truncate-after N`` keeps the one history of lines before it.
    """
    expected, out = 1, []
    for lineno, r in enumerate(records, 1):
        if r.get("kind") != "iter":
            continue
        if r.get("iteration") != expected:
            found = r.get("iteration")
            how = (
                f"iteration {found} again (a second history: two writers, or logs joined)"
                if isinstance(found, int) and found < expected
                else f"iteration {found} where {expected} comes next"
            )
            run_dir = os.path.dirname(os.path.abspath(path))
            raise RunError(
                f"{path}: line {lineno} holds {how}; espert never replays a mixed history. Keep "
                f"iterations 1..{expected - 1} with: espert repair {run_dir} --truncate-after {expected - 1}"
            )
        out.append(r)
        expected += 1
    return out


def single_history(path: str, n: int) -> tuple[int, list[dict]]:
    """``(bytes, records)``: the longest intact prefix of the log at ``path`` that holds iterations 1..n
    and nothing after n: it ends before the first line that is damaged, repeats or skips an iteration,
    belongs to an iteration after n, or is a torn tail.  RunError when that prefix ends before n."""
    with open(path, "rb") as f:
        data = f.read()
    pos, last, recs = 0, 0, []
    while pos < len(data):
        end = data.find(b"\n", pos)
        if end < 0:
            break
        rec, _ = _parse_line(data[pos:end])
        if rec is None:
            break
        it = rec.get("iteration")
        if rec.get("kind") == "iter":
            if it != last + 1 or it > n:
                break
            last = it
        elif isinstance(it, int) and it > last:  # an eval or checkpoint of an iteration not kept
            break
        recs.append(rec)
        pos = end + 1
    if last < n:
        raise RunError(
            f"{path}: only iterations 1..{last} form one intact history (line {len(recs) + 1} ends it); "
            f"use --truncate-after {last} or less"
        )
    return pos, recs


def first_record(path: str) -> dict | None:
    """The log's first record, read alone (a run's ``config`` record: the settings it started with); None when
    the log is missing or empty.  RunError naming the file when that line is damaged."""
    try:
        with open(path, "rb") as f:
            line = f.readline()
    except FileNotFoundError:
        return None
    if not line.endswith(b"\n"):
        return None  # empty, or a torn tail: no record yet
    rec, problem = _parse_line(line[:-1])
    if rec is None:
        raise RunError(f"{path}: line 1 is damaged: {problem}; refusing to guess")
    return rec


def checkpoint_hashes(records: list[dict]) -> dict[str, int]:
    """sha256 -> iteration of every checkpoint the log recorded."""
    return {r["sha256"]: r["iteration"] for r in records if r.get("kind") == "checkpoint" and "sha256" in r}
