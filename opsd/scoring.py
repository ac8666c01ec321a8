"""Score completions: next-token logits of a model on the completion positions only."""

from __future__ import annotations

import torch

from opsd.sequences import ForwardBatch

SCORING_METHOD = "opsd_completion_logits"
"""A sharded (FSDP2) model scores through this method of its own, registered as an FSDP forward
method (opsd/trainer/fsdp.py) so that FSDP gathers the parameters outside the blocks around it."""


def completion_logits(model, batch: ForwardBatch) -> torch.Tensor:
    """[N, V] logits predicting each completion token, in `batch.completion_ids` order.

    The LM head runs on the completion positions alone: prompts (with many image tokens) can be
    far longer than completions, and [B, L, V] logits would dominate memory.
    """
    sharded = getattr(model, SCORING_METHOD, None)
    if sharded is not None:
        return sharded(batch)
    return forward_completion_logits(model, batch)


def forward_completion_logits(model, batch: ForwardBatch) -> torch.Tensor:
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in batch.inputs.items()}
    hidden = model.model(**inputs).last_hidden_state
    return model.get_output_embeddings()(hidden[batch.predicts_completion.to(device)])
