"""Prove, at every ``es_setup``, that weight edits reach the engine's forward pass.

An engine can run from copies of its weights that in-place edits never touch (vLLM-CPU's oneDNN prepacks,
a compiled graph that baked a handler in, a CUDA graph over reallocated tensors), and nothing errors then:
rewards just stop depending on the perturbation.  So for one tensor of each module kind in :data:`KINDS`
among the selected parameters (for experts every expert of one fused tensor: a probe token reaches only the
experts it is routed to), :func:`check_edits_reach_forward` perturbs that tensor alone, runs the engine's
own forward pass (vLLM's ``_dummy_run``: the compiled or captured graph generation runs) on
:data:`PROBE_TOKENS` tokens, requires the hidden states (for lm_head, or an embedding tied to it, the logits)
to change, restores, and requires the output to be bit-identical to the baseline; otherwise it raises
:class:`EditsNotVisible` naming the tensor, after restoring it.  Every TP rank runs the same sequence.

Attention weights are not probed: a dummy forward skips its KV-cache writes, so no attention weight can
move its output (measured); they are Linear layers on the MLP's path, and tests/test_vllm_compiled.py checks
generation with attention-only perturbations.  docs/vllm.md, trap 5.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from espert.center import CenterStore
from espert.vllm.patches import INSTALLED, NEWEST, OLDEST, installed_version, releases, runner_name

if TYPE_CHECKING:  # the runner espert drives (tools/vllm_contract.py checks its members in every vLLM release)
    try:  # vLLM's V1 model runner (0.11 to 0.33), or its V2 runner (0.12 on; the only one in 0.34)
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

#: σ of the probe perturbation: large enough to move a bf16 weight of any usual scale (norm weights ≈ 1).
SIGMA = 0.05
#: Tokens of the probe forward pass (ids 1..N; id 0 is often a zero padding embedding).
PROBE_TOKENS = 4
SEED = 20261201

KINDS = ("embedding", "mlp", "experts", "norm", "lm_head")


class EditsNotVisible(RuntimeError):
    """An edit of the live weights did not change the forward pass, or its restore did not undo it."""


def kind_of(name: str) -> str | None:
    """The module kind of a logical parameter name (``model.layers.0.self_attn.q_proj.weight`` → attention)."""
    parts = name.split(".")
    if "lm_head" in parts:
        return "lm_head"
    if any("embed" in p for p in parts):
        return "embedding"
    if any("norm" in p for p in parts):
        return "norm"
    if any("attn" in p or "attention" in p for p in parts):
        return "attention"
    if "experts" in parts:
        return "experts"
    if any("mlp" in p or "ffn" in p or "expert" in p for p in parts):
        return "mlp"
    return None


def probe_views(views) -> list:
    """One view of each kind in :data:`KINDS` order, chosen in model order so every TP rank picks the same
    logical tensor: the first of each kind, except the last norm (the final norm; a layer's input norm
    feeds only attention, which is not probed: module docstring)."""
    chosen: dict[str, object] = {}
    for v in views:
        k = kind_of(v.name)
        if k in KINDS and (k not in chosen or k == "norm"):
            chosen[k] = v
    return [chosen[k] for k in KINDS if k in chosen]


def _probed_with(v, views) -> list:
    """The views one probe perturbs: ``v``, or for an expert every expert of its live tensor (a probe token is
    routed to a few experts, which need not include ``v``'s)."""
    if kind_of(v.name) != "experts":
        return [v]
    ptr = v.tensor.untyped_storage().data_ptr()
    return [u for u in views if kind_of(u.name) == "experts" and u.tensor.untyped_storage().data_ptr() == ptr]


def _logits(runner: GPUModelRunner, hidden):
    """Logits of ``hidden``, or None on the TP ranks that vLLM does not gather them to."""
    out = runner.model.compute_logits(hidden)
    return None if out is None else out.clone()


def _probe_ids(runner) -> torch.Tensor:
    """The probe's token ids: 1..N modulo the vocabulary (int64 [PROBE_TOKENS])."""
    return torch.arange(1, PROBE_TOKENS + 1) % runner.model_config.get_vocab_size()


@releases("0.11", "0.33")
def _forward_v1(runner: GPUModelRunner):
    """The probe through vLLM's V1 model runner: ids in its ``input_ids`` buffer, then a dummy run that
    builds attention metadata."""
    ids = runner.input_ids.gpu[:PROBE_TOKENS]
    ids.copy_(_probe_ids(runner).to(ids.device))
    hidden, _ = runner._dummy_run(PROBE_TOKENS, force_attention=True)
    return hidden


def _forward(runner: GPUModelRunner):
    """(hidden states, logits of them) of the probe tokens through the engine's own forward (compiled or not),
    on vLLM's V1 model runner (0.11 to 0.33) or its V2 runner (0.12 on); another runner is refused
    (:class:`EditsNotVisible`): nothing would prove that edits reach its forward pass."""
    kind = runner_name(runner)
    if kind.startswith("V2") and "probe_ids" in INSTALLED:
        from espert.vllm.patches.probe_ids import probe_forward

        hidden = probe_forward(runner, _probe_ids(runner))
    elif kind.startswith("V1") and hasattr(runner, "input_ids") and hasattr(runner, "_dummy_run"):
        hidden = _forward_v1(runner)
    else:
        raise EditsNotVisible(
            f"espert self-test: cannot run a probe forward pass through {kind} (vLLM {installed_version()}), "
            f"so nothing proves that weight edits reach this engine; espert is checked on vLLM {OLDEST} to "
            f"{NEWEST}, V1 and V2 model runners (docs/vllm.md, 'vLLM versions')"
        )
    hidden = hidden[:PROBE_TOKENS].clone()
    return hidden, _logits(runner, hidden)


def _same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _tp_group():
    """vLLM's tensor-parallel group, or None for a single worker."""
    try:
        from vllm.distributed import get_tp_group

        group = get_tp_group()
    except Exception:  # noqa: BLE001 - not initialised: a single worker
        return None
    return group if group.world_size > 1 else None


def _all_ranks(ok: bool) -> bool:
    """Whether ``ok`` holds on every TP rank: the ranks must raise together, or the others would wait in
    the next forward's collectives forever."""
    group = _tp_group()
    if group is None:
        return ok
    flag = torch.tensor([int(ok)])
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group.cpu_group)
    return bool(flag.item())


def _names_on_any_rank(names: list[str]) -> list[str]:
    """The probe names of every TP rank, in :data:`KINDS` order: a rank may hold no piece of a tensor (a
    vocab shard of padding rows), yet it must run the same forwards as the others."""
    group = _tp_group()
    if group is None:
        return names
    every: list = [None] * group.world_size
    torch.distributed.all_gather_object(every, names, group=group.cpu_group)
    by_kind: dict[str, str] = {}
    for ns in every:  # ranks choose by the same rule, so a kind's name agrees wherever it exists
        for n in ns:
            by_kind.setdefault(kind_of(n), n)
    return [by_kind[k] for k in KINDS if k in by_kind]


def _tied_embedding(model: torch.nn.Module) -> bool:
    """Whether lm_head computes from an input embedding's storage (the same on every TP rank)."""
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    if not isinstance(head, torch.Tensor) or head.numel() == 0:
        return False
    ptr = head.untyped_storage().data_ptr()
    return any(
        "embed" in n and p.untyped_storage().data_ptr() == ptr
        for n, p in model.named_parameters(remove_duplicate=False)
    )


def check_edits_reach_forward(runner: GPUModelRunner, model: torch.nn.Module, views, wrap) -> list[str]:
    """Run the self-test (module docstring) over ``views``; returns the probed logical names.

    runner: the vLLM model runner, V1 or V2; model: the live model; wrap: ``fn(center, model) -> center``
    that makes a center's edits visible to the engine (:class:`~espert.vllm.engine.repack.RepackingCenter`).
    Views that are not float tensors (W8A8 codes) are not probed.
    """
    local = {v.name: v for v in probe_views(views) if getattr(v, "qv", None) is None and v.tensor.is_floating_point()}
    names = _names_on_any_rank(list(local))
    if not names:
        return []
    tied = _tied_embedding(model)
    engine = f"{runner_name(runner)} model runner, vLLM {installed_version()}"
    with torch.inference_mode():
        base_h, base_logits = _forward(runner)
        for name in names:
            v = local.get(name)  # None: this rank holds no piece of it, and only joins the forwards
            one = wrap(CenterStore(_probed_with(v, views)), model) if v is not None else None
            head = kind_of(name) == "lm_head" or (kind_of(name) == "embedding" and tied)
            try:
                if one is not None:
                    one.perturb(SEED, SIGMA)
                h, _ = _forward(runner)
                moved = kind_of(name) == "lm_head" or not torch.equal(h, base_h)
                # lm_head (or an embedding tied to it) must move the logits of the unperturbed hidden
                # states (computed on every rank: it is collective), on the ranks that hold its piece
                if head:
                    logits = _logits(runner, base_h)
                    if v is not None and base_logits is not None:
                        moved = moved and not torch.equal(logits, base_logits)
            finally:
                if one is not None:
                    one.restore()
            if not _all_ranks(moved):
                raise EditsNotVisible(
                    f"espert self-test: perturbing {name} ({kind_of(name)}) did not change the engine's "
                    f"forward pass ({engine}), so ES would train on rewards that ignore the perturbation.  A compiled or "
                    f"graph-captured engine is running from a copy of the weights espert cannot refresh: "
                    f"create the LLM with enforce_eager=True"
                )
            h, logits = _forward(runner)
            back = torch.equal(h, base_h) and _same(logits, base_logits)
            if not _all_ranks(back):
                raise EditsNotVisible(
                    f"espert self-test: after restoring {name} exactly, the engine's forward pass ({engine}) "
                    f"differs from before the edit (the engine computes from a stale or non-deterministic copy of "
                    f"the weights); create the LLM with enforce_eager=True"
                )
    return names
