"""Weight reload inside a vLLM worker: one layerwise-reload session per weight update.

The colocated engine runs these through `LLM.collective_rpc` (in-process: callables and tensors pass
as they are); the server's worker extension (opsd/rollout/server_worker.py) calls them on buckets it
reads from files.
"""

from __future__ import annotations

import torch


def begin_reload(worker) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(worker.model_runner.get_model())


def load_bucket(worker, bucket) -> None:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        worker.model_runner.get_model().load_weights(iter(bucket))


def finish_reload(worker) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config):
        finalize_layerwise_reload(worker.model_runner.get_model(), worker.vllm_config.model_config)
        _reprocess_shared_weights(worker.model_runner.get_model())
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
