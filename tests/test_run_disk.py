"""Disk a user can plan: what a run directory and a replay write, and in which dtype.

A 0.5 B model from a GGUF (float32 after dequantization) took 4.8 GB per run directory (the float32
center and a float32 export) and another 4.8 GB per ``espert replay --out``.
"""

import json
import os

import pytest
import torch
from conftest import SMALL_RUN
from safetensors import safe_open

from espert import runs, train
from espert.cli import main
from espert.config import ESConfig

SMALL = {**SMALL_RUN, "iterations": 2, "checkpoint_every": 2, "eval_every": 0}


def export_dtypes(export_dir):
    with safe_open(os.path.join(export_dir, "model.safetensors"), "pt") as f:
        return {k: f.get_slice(k).get_dtype() for k in f.keys()}


@pytest.fixture(scope="module")
def local_run(tiny_dir, tmp_path_factory):
    """A run on a local model directory (the tiny float32 model), default export dtype."""
    d = str(tmp_path_factory.mktemp("disk") / "run")
    train(ESConfig(**{**SMALL, "model": tiny_dir}), d, progress=False, echo=None)
    return d


def test_a_run_on_a_local_model_keeps_no_copy_of_it(local_run, tiny_dir):
    """The base is referenced (path and sha256 in config.yaml), not copied: the run directory holds its config,
    log, float32 center and export, nothing else.  (Passed before this change: a guard.)"""
    assert sorted(os.listdir(local_run)) == ["center.safetensors", "config.yaml", "export", "log.jsonl"]
    doc = runs.read_run_config(local_run)
    assert doc["base_model"] == os.path.abspath(tiny_dir) and doc["base_fingerprint"]
    assert set(export_dtypes(os.path.join(local_run, "export")).values()) == {"F32"}  # the base's dtype


def test_export_dtype_is_asked_for_and_may_change_on_resume(local_run, tmp_path):
    """``export_dtype: bfloat16`` writes the export in bfloat16 (each tensor the center's round to nearest even,
    config.json saying so) at half the bytes; the center stays float32.  A resume may change it."""
    import shutil

    d = str(tmp_path / "run")
    shutil.copytree(local_run, d)
    base = runs.read_run_config(local_run)["base_model"]
    cfg = ESConfig(**{**SMALL, "model": base, "export_dtype": "bfloat16", "iterations": 3})
    train(cfg, d, resume=True, progress=False, echo=None)  # one more iteration; its checkpoint exports in bf16
    export = os.path.join(d, "export")
    assert set(export_dtypes(export).values()) == {"BF16"}
    assert json.load(open(os.path.join(export, "config.json")))["dtype"] == "bfloat16"
    state, it = runs.load_center(os.path.join(d, runs.CENTER))
    assert it == 3 and all(v.dtype == torch.float32 for v in state.values())
    with safe_open(os.path.join(export, "model.safetensors"), "pt") as f:
        for k in f.keys():
            if k in state:
                assert torch.equal(f.get_tensor(k), state[k].to(torch.bfloat16)), k
    f32 = os.path.getsize(os.path.join(local_run, "export", "model.safetensors"))
    assert os.path.getsize(os.path.join(export, "model.safetensors")) < 0.51 * f32 + 4096


def test_replay_writes_only_what_it_is_asked_for(local_run, tmp_path, capsys):
    """``--write export`` writes the export alone, ``--write center`` the center alone, ``--write none`` nothing;
    each still compares the replayed center with the run's checkpoint.  The default writes both, as before."""
    for what, expected in (("export", ["export"]), ("center", ["center.safetensors"]), ("none", [])):
        out = tmp_path / what
        assert main(["replay", local_run, "--out", str(out), "--write", what]) == 0
        err = capsys.readouterr().err
        assert "bit-identical" in err and ": yes" in err, err
        assert (sorted(os.listdir(out)) if out.exists() else []) == expected, what
    res = runs.replay(local_run, str(tmp_path / "both"), echo=None)
    assert res["matches_checkpoint"] is True
    assert sorted(os.listdir(tmp_path / "both")) == ["center.safetensors", "export"]
    assert main(["replay", local_run, "--out", str(tmp_path / "bad"), "--write", "weights"]) == 2
    assert not (tmp_path / "bad").exists()


def test_replay_exports_in_the_runs_export_dtype(local_run, tmp_path):
    import shutil

    d = str(tmp_path / "run")
    shutil.copytree(local_run, d)
    doc = runs.read_run_config(d)
    doc["config"]["export_dtype"] = "float16"
    runs.atomic_write_text(os.path.join(d, runs.CONFIG), __import__("yaml").safe_dump(doc, sort_keys=False))
    runs.replay(d, str(tmp_path / "out"), echo=None)
    assert set(export_dtypes(str(tmp_path / "out" / "export")).values()) == {"F16"}
