"""Replay: rebuild a run's center from its base model and log alone, on the CPU."""

from __future__ import annotations

import os
import time
from typing import Callable

import torch

from espert.config import ESConfig
from espert.es import apply_record
from espert.files import BASE, CENTER, EXPORT, LOG, RunError, check_output_path, writing_into
from espert.progress import bar, ticking
from espert.runs.checkpoint import load_center, save_center
from espert.runs.export import base_identity, export_iteration, export_model, resolve_model_dir
from espert.runs.fingerprint import check_base
from espert.runs.log import checkpoint_hashes, iteration_records, read_log
from espert.runs.run import read_run_config

#: What a replay can write: the float32 center checkpoint, the HF-format export.
WRITABLE = ("center", "export")


def replay(
    run_dir: str,
    out_dir: str | None = None,
    upto: int | None = None,
    echo: Callable[[str], None] | None = print,
    member: int | None = None,
    write: tuple[str, ...] = WRITABLE,
) -> dict:
    """Rebuild a run's center from its base model and log alone, on the CPU.

    Writes what ``write`` names of ``OUT/center.safetensors`` (``"center"``) and ``OUT/export/``
    (``"export"``, in the run's ``export_dtype``) (default OUT: RUN/replay; ``write=()``: nothing, a
    check), and compares with the run's own checkpoint when that is at the same iteration.  upto: stop after this
    iteration (default: the last logged one).  Returns ``{"iteration", "out", "matches_checkpoint"}``
    (``matches_checkpoint`` is None when there is nothing to compare with, False when the
    checkpoint differs or is damaged).  Refuses (RunError) a base model that is not the run's, and a
    log that ends before the run's checkpoint or export (records are missing).  Writing into a run
    directory (OUT inside one, as the default is) takes its writer lock (:class:`RunBusy` while another
    process writes it); reading takes none, and sees only whole log lines and verified checkpoints.

    A RandOpt run (``method: randopt``) has no updates: replay checks that every logged member's (seed, σ)
    is the config's and that the logged ensemble is the top K of the logged rewards
    (:func:`espert.randopt.check_log`), and with ``member`` (a rank in the ensemble, from 1) writes that
    member's weights, θ0 + σ·ε(seed) rebuilt by the ops, to ``OUT/export/``.
    """
    echo = echo or (lambda s: None)
    unknown = sorted(set(write) - set(WRITABLE))
    if unknown:
        raise ValueError(f"replay writes {', '.join(WRITABLE)} or nothing, not {', '.join(unknown)}")
    out_dir = out_dir or os.path.join(run_dir, "replay")
    check_output_path(out_dir, "replay output directory")
    doc = read_run_config(run_dir)
    if ESConfig.from_dict(doc["config"]).method == "randopt":
        with writing_into(out_dir):
            return _replay_randopt(run_dir, out_dir, doc, member, echo)
    if member is not None:
        raise ValueError("--member is for RandOpt runs (method: randopt); this run's method is es")
    if not write:
        return _replay(run_dir, out_dir, upto, echo, ())
    with writing_into(out_dir):  # into a run (the default: RUN/replay): one writer at a time
        return _replay(run_dir, out_dir, upto, echo, tuple(write))


def _base_dir(run_dir: str, doc: dict, echo) -> str:
    """The run's base model directory, checked against its fingerprint (a GGUF before it is converted)."""
    base_ref = doc["base_model"]
    base = os.path.join(run_dir, BASE) if base_ref == BASE else base_identity(base_ref)
    check_base(base, doc.get("base_fingerprint"), echo)
    return base if base_ref == BASE else resolve_model_dir(base_ref)


def _replay_randopt(run_dir: str, out_dir: str, doc: dict, member: int | None, echo) -> dict:
    from espert.evaluators import config_center, load_model
    from espert.randopt import check_log

    cfg = ESConfig.from_dict(doc["config"])
    res = check_log(cfg, read_log(os.path.join(run_dir, LOG)))
    echo(
        f"[espert] randopt run: {res['members']} members logged, each (seed, sigma) the config's; ensemble: "
        + ("the top K of the logged rewards" if res["ensemble"] else "not selected yet (the run is unfinished)")
    )
    if member is not None:
        if not res["ensemble"] or not 1 <= member <= len(res["ensemble"]):
            raise ValueError(f"--member must be a rank in the ensemble (1..{len(res['ensemble'] or [])}), got {member}")
        base = _base_dir(run_dir, doc, echo)
        model, _ = load_model(base, device="cpu", dtype=cfg.dtype)
        center = config_center(model, cfg)
        if not hasattr(center, "mirrors"):
            raise ValueError("--member exports float weights; this RandOpt run perturbs quantized codes")
        seed, sigma = res["ensemble"][member - 1]
        center.perturb(seed, sigma, 1)
        live = {v.name: v.tensor.detach().float() for v in center.views}
        note = {"replayed_from": run_dir, "randopt_member": member, "seed": seed, "sigma": sigma}
        export_model(live, base, os.path.join(out_dir, EXPORT), iteration=0, note=note)
        echo(f"[espert] ensemble member {member} (seed {seed}, sigma {sigma:g}) -> {os.path.join(out_dir, EXPORT)}")
    return {"iteration": 0, "out": out_dir, "matches_checkpoint": None, "randopt": res}


def _replay(run_dir: str, out_dir: str, upto: int | None, echo: Callable[[str], None], write: tuple) -> dict:
    from espert.evaluators import config_center, load_model

    doc = read_run_config(run_dir)
    cfg = ESConfig.from_dict(doc["config"])
    base = _base_dir(run_dir, doc, echo)
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
    with ticking("[espert] loading the base model"):
        model, _ = load_model(base, device="cpu", dtype=cfg.dtype)
    center = config_center(model, cfg)  # the center training built (quantization, optimizer, decay exclusions)
    t0 = time.time()
    with bar("[espert] replaying the logged updates", len(its), "update") as shown:
        for rec in its:
            apply_record(center, rec)  # a Center has the Evaluator's update signature
            shown.update(1)
    last = its[-1]["iteration"] if its else 0
    state = center.state_dict()
    _write_replayed(center, state, base, out_dir, last, run_dir, cfg.export_dtype, write)
    match = None
    if ck_error is not None and upto is None:
        match = False
    elif ref is not None and ref[1] == last:
        match = set(ref[0]) == set(state) and all(torch.equal(ref[0][n], state[n]) for n in state)
    echo(
        f"[espert] replayed {len(its)} updates in {time.time() - t0:.1f}s -> "
        + (f"{out_dir} ({' and '.join(write)})" if write else "nothing written")
        + ("" if match is None or ck_error else f"; bit-identical to {ck}: {'yes' if match else 'NO'}")
    )
    if ck_error is not None:
        echo(f"[espert] cannot compare with the run's checkpoint: {ck_error}")
    return {"iteration": last, "out": out_dir, "matches_checkpoint": match}


def _write_replayed(center, state, base: str, out_dir: str, last: int, run_dir: str, dtype: str, write) -> None:
    """The replayed center (``"center"`` in ``write``) and its export (``"export"``) into ``out_dir``."""
    if not write:
        return
    os.makedirs(out_dir, exist_ok=True)
    if "center" in write:
        save_center(os.path.join(out_dir, CENTER), state, last)
    if "export" in write:
        note = {"replayed_from": run_dir}
        export_model(center.export_state(), base, os.path.join(out_dir, EXPORT), iteration=last, note=note, dtype=dtype)
