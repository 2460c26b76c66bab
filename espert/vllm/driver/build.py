"""``evaluator: vllm`` from a run config (:mod:`espert.evaluators` registers :func:`build_from_config`): one in-process
engine or an :class:`~espert.vllm.driver.pool.EnginePool`, and the center fields every engine's workers get."""

from __future__ import annotations

from espert.evaluators.base import Evaluator


def center_kwargs(cfg, model_path: str) -> dict:
    """The center's loop fields of ``cfg`` as :class:`VLLMEvaluator` / :class:`EnginePool` keywords
    (``noise``, ``quant_master``, ``optimizer``, ``no_decay``, ``anchor``, ``sigma_scales``), as
    :func:`espert.evaluators.torch_model.config_center` gives them to the torch evaluator's CenterStore.
    The rms scales are computed once, here, from the checkpoint's whole tensors, so every engine and TP
    rank gets the same."""
    from espert.evaluators.torch_model import optimizer_spec

    return dict(
        noise=cfg.noise,
        quant_master=cfg.quant_master,
        optimizer=optimizer_spec(cfg),
        no_decay=list(cfg.weight_decay_exclude) if cfg.weight_decay else [],
        anchor=cfg.anchor_decay > 0,
        sigma_scales=checkpoint_rms_scales(model_path, cfg.dtype, cfg.include, cfg.exclude)
        if cfg.sigma_mode == "rms"
        else None,
    )


def build_from_config(cfg, model_path: str, score, extract=None) -> Evaluator:
    """``evaluator: vllm``: one in-process engine, or an :class:`EnginePool` when ``cfg.vllm_engines`` > 1 or an
    engines file is given (the pool follows the number in it between iterations), with the ``vllm_*`` engine
    fields and the center's loop fields (:func:`center_kwargs`).  extract: the task's answer extractor (the
    evaluator then fills ``member_answers``).  A malformed ``vllm_rename`` is refused before any engine starts.
    """
    from espert.vllm.driver.evaluator import VLLMEvaluator, parse_rename

    rename = parse_rename(cfg.vllm_rename)
    llm_kwargs = dict(dtype=cfg.dtype, tensor_parallel_size=cfg.vllm_tensor_parallel_size)
    if cfg.vllm_gpu_memory_utilization is not None:
        llm_kwargs["gpu_memory_utilization"] = cfg.vllm_gpu_memory_utilization
    if cfg.vllm_max_model_len is not None:
        llm_kwargs["max_model_len"] = cfg.vllm_max_model_len
    ev_kwargs = dict(
        include=cfg.include,
        exclude=cfg.exclude,
        max_new_tokens=cfg.max_new_tokens,
        seed=cfg.seed,
        chat_template=cfg.chat_template,
        member_errors=cfg.member_errors,
        rename=rename,
        extract=extract,
        members=cfg.vllm_members,
        max_loras=cfg.vllm_max_loras,
        **center_kwargs(cfg, model_path),
    )
    if cfg.vllm_engines > 1 or cfg.vllm_engines_file:
        from espert.vllm.driver.pool import EnginePool

        return EnginePool(
            model_path,
            score,
            engines=cfg.vllm_engines,
            engines_file=cfg.vllm_engines_file,
            deadline_floor=cfg.vllm_deadline_floor,
            llm_kwargs=llm_kwargs,
            **ev_kwargs,
        )
    return VLLMEvaluator(model_path, score, llm_kwargs=llm_kwargs, **ev_kwargs)


def checkpoint_rms_scales(model: str, dtype: str, include=None, exclude=None) -> dict[str, float]:
    """``{checkpoint name: σ multiplier}`` for ``sigma_mode: rms``: :func:`~espert.evaluators.torch_model.tensor_rms`
    of each whole checkpoint tensor as loaded in ``dtype``, for the names include / exclude select.  Computed
    on the driver, one tensor at a time, so a TP shard or a piece of a fused parameter gets the scale of its
    whole logical tensor, bit for bit the torch evaluator's.  Raises without a safetensors checkpoint.
    """
    from safetensors import safe_open

    from espert.evaluators.torch_model import tensor_rms, torch_dtype
    from espert.params import matches
    from espert.tensorfile import checkpoint_files

    files = checkpoint_files(model)
    if files is None:
        raise FileNotFoundError(
            f"sigma_mode=rms with vLLM reads the base tensors from a safetensors checkpoint; {model} has none"
        )
    dt = torch_dtype(dtype)
    out = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                if (include and not matches(name, include)) or (exclude and matches(name, exclude)):
                    continue
                t = st.get_tensor(name)
                if t.is_floating_point():
                    out[name] = tensor_rms(t.to(dt))
    return out
